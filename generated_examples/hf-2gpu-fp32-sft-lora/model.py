"""A Hugging Face transformers causal LM, filled in place on the sharded model.

train.py builds the model from its config.json on the meta device (no memory), shards it, allocates each
rank's shards with `to_empty`, and then fills them with one of:

- `load_pretrained`: every rank reads, through DCP's HuggingFaceStorageReader, only the slices of the
  safetensors files that its own shards hold; no rank holds a whole tensor and nothing is broadcast. That needs
  every rank to see the same files: it checks (names and sizes, as every rank lists them), and where some rank
  does not (a folder on rank 0's node only), rank 0 reads each file whole and broadcasts it, with a warning.
- `init_from_scratch`: the model's own initialisation (transformers' `_init_weights`), on the shards, equal
  bit for bit whatever the number of ranks (and in every replica of HSDP).

Either way the non-persistent buffers (rotary `inv_freq` and the like) are recomputed by the model's own
code: they are not in the checkpoint, and `to_empty` leaves them as garbage.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.utils.error import NoMatchingPeftModuleError
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)
from transformers.distributed.sharding_utils import DtensorShardOperation
from transformers.modeling_outputs import CausalLMOutputWithPast

from chunked_loss import chunked_cross_entropy
from data import IGNORE
from errors import stop
from model_args import HUB_FILES, MODEL_RULES, RESUME_MAY_CHANGE, ModelArgs

if TYPE_CHECKING:  # config.py imports model_args.py, never this file: no import cycle, and no torch to read a config
    from config import Config

# The names train.py, preflight.py and the scripts import from every family's model.py (AGENTS.md lists them);
# HUB_FILES: the files of a hub model, which scripts/export.py copies.
__all__ = ["HUB_FILES", "MODEL_RULES", "RESUME_MAY_CHANGE", "Model", "ModelArgs", "balance_experts", "block_classes",
           "build_model", "initialize", "loss", "output_logits"]  # fmt: skip


class PretrainedLoadError(Exception):
    """The weights in the model folder cannot be loaded; raised on every rank together, with rank 0's message."""


def load_pretrained(model: PreTrainedModel, folder: Path) -> None:
    """Fill the sharded `model` with the weights in `folder`, on every rank.

    Where every rank sees the same files (one shared folder, or the same copy on every node), each rank reads only
    the slices of its own shards through DCP's HuggingFaceStorageReader: no rank holds a whole tensor, nothing
    is broadcast. Otherwise (e.g. the folder is on rank 0's node only) rank 0 reads every file and broadcasts it
    (load_from_rank0), and says so. Raises PretrainedLoadError on every rank together, with rank 0's message.
    """
    rank = dist.get_rank()
    files, error = [], None
    try:
        files = [(file, (folder / file).stat().st_size) for file in safetensors_files(folder)]
    except (OSError, ValueError) as exc:
        error = f"cannot list the weights of {folder}: {exc}"
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (files, error))
    share_from_rank0(None, seen[0][1])  # rank 0's error: every rank raises it
    # Every rank takes the same decision: the same files (names and sizes) as rank 0's on every rank.
    blind = [other for other, (other_files, _) in enumerate(seen) if other_files != seen[0][0]]
    if not blind:
        load_slices(model, folder)
    else:
        if rank == 0:
            print(
                f"warning: rank(s) {blind[:8]} do not see the files of {folder} that rank 0 sees: rank 0 reads them "
                "and broadcasts every tensor (slower, and rank 0 holds one whole file at a time); put the model "
                "in a folder every rank sees to read it in parallel",
                flush=True,
            )
        load_from_rank0(model, folder)
    finish_pretrained(model)


def load_slices(model: PreTrainedModel, folder: Path) -> None:
    """Every rank reads the slices of the files its shards hold (dcp.load with HuggingFaceStorageReader), into
    the model's own tensors; safetensors maps the files, so a slice costs its own bytes only. copy_ into the
    fp32 shards converts bf16 or fp16 files exactly, as from_pretrained does."""
    reader = HuggingFaceStorageReader(str(folder))
    shapes, error = {}, None
    try:
        shapes = {key: meta.size for key, meta in reader.read_metadata().state_dict_metadata.items()}
    except Exception as exc:  # a truncated or foreign file: safetensors' own error names it
        error = f"cannot read the weights of {folder}: {type(exc).__name__}: {exc}"
    first_error(error)
    names = tensor_names(model)
    tensors = {id(tensor): tensor for tensor, _ in state_names(model)}
    by_name = {name: key for key, group in names.items() for name in group}
    conversions = Conversions(model, names)
    renamed = {key: conversions.model_key(key) for key in shapes}
    error = missing_or_unexpected(model, folder, names, {name for name, _ in renamed.values()})
    # The file's key for each tensor (the first of a tied group that the file has), and the model's tensor; the
    # keys that transformers converts (per-expert weights into the model's fused ones), by the model's tensor.
    state: dict[str, torch.Tensor] = {}
    converted: dict[str, list[tuple[str, str]]] = {}
    chosen: set[int] = set()
    for key in sorted(shapes, key=dot_natural_key):  # experts 0, 1, ..., 10 in order (a converter stacks them)
        name, pattern = renamed[key]
        tensor = tensors.get(by_name.get(name, -1))
        if tensor is not None and pattern is not None:
            converted.setdefault(name, []).append((key, pattern))
            continue
        if tensor is None or id(tensor) in chosen:
            continue  # a weight the model does not use, or a tied weight's second name
        chosen.add(id(tensor))
        if error is None and tuple(tensor.shape) != tuple(shapes[key]):
            error = (
                f"{folder} has {key} of shape {list(shapes[key])} but the model's is {list(tensor.shape)}; "
                "its config.json must be the one the weights were saved with"
            )
        state[key] = tensor.detach()
    first_error(error)
    try:
        # A collective; each rank copies into its own DTensor shards (replicated tensors: the whole tensor).
        dcp.load(state, storage_reader=reader)
    except Exception as exc:  # CheckpointException, on every rank together: the first rank's failure
        failures = getattr(exc, "failures", None) or {0: exc}
        cause = failures[min(failures)]
        text = str(getattr(cause, "exc", cause)).strip().splitlines() or [""]
        raise PretrainedLoadError(f"cannot read the weights of {folder}: {type(cause).__name__}: {text[0]}") from None
    if converted:
        by_model_name = {name: tensors[key] for name, key in by_name.items()}
        try:
            error = load_converted(model, folder, converted, by_model_name, conversions)
        except Exception as exc:  # a file this rank cannot read: every rank stops together, not just this one
            error = f"cannot read the weights of {folder}: {type(exc).__name__}: {exc}"
        first_error(error)


class Conversions:
    """transformers' own rules for turning a checkpoint's keys into the model's (those from_pretrained applies;
    transformers.conversion_mapping): renamed keys (Mixtral's block_sparse_moe -> mlp), and WeightConverters that
    build one tensor of the model from several of the files (the per-expert weights of a mixture-of-experts
    checkpoint, stacked into the fused experts tensors transformers' MoE models hold)."""

    def __init__(self, model: PreTrainedModel, names: dict[int, set[str]]):
        treat_as_library_code(model)  # else transformers skips the rules it keys by the root's class
        transforms = get_model_conversion_mapping(model)
        self.renamings = [entry for entry in transforms if isinstance(entry, WeightRenaming)]
        self.converters = [entry for entry in transforms if isinstance(entry, WeightConverter)]
        self.prefix = model.base_model_prefix
        self.known = {name: True for group in names.values() for name in group}

    def model_key(self, key: str) -> tuple[str, str | None]:
        """The model's name for the checkpoint's `key`, and the source pattern of the converter that builds it
        (None: the key's tensor is the model's tensor whole), as from_pretrained renames it."""
        name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.known)
        if name not in self.known and key in self.known:  # from_pretrained's rule too: a key the model has stays
            name, pattern = rename_source_key(key, [], [], self.prefix, self.known)
        return name, pattern

    def converter(self, pattern: str) -> WeightConverter:
        """A fresh copy of the converter with source pattern `pattern` (each builds one tensor)."""
        return copy.deepcopy(next(entry for entry in self.converters if pattern in entry.source_patterns))


def stacks_experts(converter: WeightConverter) -> bool:
    """Whether the converter stacks per-expert tensors along dim 0 (MergeModulelist) and at most joins them
    along another dim (Concatenate: gate and up into gate_up): dim 0 is what fully_shard splits, so each rank
    can read just the experts of its own shard."""
    operations = converter.operations
    return (
        isinstance(operations[0], MergeModulelist)
        and operations[0].dim == 0
        and all(isinstance(op, Concatenate) and op.dim != 0 for op in operations[1:])
    )


def load_converted(
    model: PreTrainedModel,
    folder: Path,
    groups: dict[str, list[tuple[str, str]]],
    tensors: dict[str, torch.Tensor],
    conversions: Conversions,
) -> str | None:
    """Fill each tensor of `groups` ({model name: [(checkpoint key, converter source pattern)]}) with what
    transformers' converter makes of those keys; the error, if any (first_error raises it on every rank).

    Per-expert weights that a converter stacks (stacks_experts): each rank reads from the files only the experts
    of its own shard (transformers' DtensorShardOperation, as its own sharded loading does). Other conversions:
    each rank reads the whole source tensors, converts, and keeps its part."""
    files = weight_map(folder)
    opened: dict[str, Any] = {}
    for target, sources in groups.items():
        tensor = tensors[target]
        converter = conversions.converter(sources[0][1])
        by_expert = isinstance(tensor, DTensor) and stacks_experts(converter)
        error = expert_count_error(folder, target, sources, tensor, converter)
        if error is not None:
            return error
        if by_expert and local_part(tensor).shape[0] == 0:
            continue  # a rank whose shard holds no expert (more ranks than experts)
        sharding = DtensorShardOperation(tensor) if by_expert else None
        for key, pattern in sources:
            file = files[key]
            if file not in opened:
                opened[file] = safe_open(folder / file, framework="pt")
            # The position in the converter's list is the expert's index (the keys come in dot_natural_key order).
            index = len(converter.collected_tensors.get(pattern, []))
            part = functools.partial(read_part, opened[file].get_slice(key), sharding, index, tensor.dtype)
            converter.add_tensor(target, key, pattern, part)
        values, error = run_converter(model, folder, converter, sources, tensors, whole=not by_expert)
        if error is not None:
            return error
        for name, value in values.items():
            param = tensors[name]
            if not by_expert:
                value = local_part(param, value)
            if tuple(value.shape) != tuple(local_part(param).shape):
                # This rank's experts, or their shapes, are not all in the files.
                return (f"{folder}: {described(sources)} do not make the model's {name} of shape "
                        f"{list(param.shape)} (this rank's part: {list(value.shape)} instead of "
                        f"{list(local_part(param).shape)}); {SAME_CONFIG}")  # fmt: skip
            with torch.no_grad():
                local_part(param).copy_(value)
    return None


def expert_count_error(
    folder: Path, target: str, sources: list[tuple[str, str]], tensor: torch.Tensor, converter: WeightConverter
) -> str | None:
    """The error if the files do not hold one tensor per expert for each source pattern (gate, up) of a converter
    that stacks experts: a missing one would shift the others' places."""
    if not stacks_experts(converter):
        return None
    for pattern in converter.source_patterns:
        found = sum(source_pattern == pattern for _, source_pattern in sources)
        if found not in (0, tensor.shape[0]):  # 0: the files hold the fused tensor under another name
            return (f"{folder} has {found} tensors {pattern} for the model's {target} of {tensor.shape[0]} "
                    f"experts; {SAME_CONFIG}")  # fmt: skip
    return None


def run_converter(
    model: PreTrainedModel,
    folder: Path,
    converter: WeightConverter,
    sources: list[tuple[str, str]],
    tensors: dict[str, torch.Tensor],
    whole: bool,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The tensors transformers' `converter` makes of the `sources` it collected ({model name: tensor}), or the
    error: the conversion fails, makes a tensor the model lacks, or (`whole`: whole tensors) of another shape."""
    target = next(iter(converter.layer_targets))
    try:
        values = converter.convert(target, model=model, config=model.config)
    except Exception as exc:
        return {}, (f"transformers cannot convert {described(sources)} of {folder} into the model's {target} "
                    f"({type(exc).__name__}: {exc}); {RESAVE}")  # fmt: skip
    for name, value in values.items():
        if name not in tensors:
            lacks = f"transformers converts {described(sources)} of {folder} into {name}, which the model lacks"
            return {}, f"{lacks}; {RESAVE}"
        if whole and tuple(value.shape) != tuple(tensors[name].shape):
            return {}, (f"{folder}: {described(sources)} converted by transformers has shape {list(value.shape)} but "
                        f"the model's {name} is {list(tensors[name].shape)}; {SAME_CONFIG}")  # fmt: skip
    return values, None


def described(sources: list[tuple[str, str]]) -> str:
    """The checkpoint keys of a conversion, for a message: the first, and how many."""
    return f"{sources[0][0]} ... ({len(sources)} tensors)" if len(sources) > 1 else sources[0][0]


SAME_CONFIG = "its config.json must be the one the weights were saved with"
# The way out when transformers cannot convert a checkpoint here: the model's own layout, which needs no conversion.
RESAVE = (
    "save the model once in transformers' own layout (from_pretrained, then save_pretrained(folder, "
    "save_original_format=False)) and train from that folder"
)


def read_part(source: Any, sharding: DtensorShardOperation | None, index: int, dtype: torch.dtype) -> torch.Tensor:
    """One checkpoint tensor (a safetensors slice, read only now): whole, or the part of it this rank's shard
    holds (None for an expert of another rank's shard)."""
    if sharding is None:
        return source[...].to(dtype)
    return sharding.shard_tensor(source, tensor_idx=index, dtype=dtype)


def local_part(param: torch.Tensor, whole: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of `param` (itself if not sharded), or the same part of `whole`, a tensor of its shape."""
    if not isinstance(param, DTensor):
        return param if whole is None else whole
    if whole is None:
        return param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))]


def weight_map(folder: Path) -> dict[str, str]:
    """{checkpoint key: its safetensors file} of `folder`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        return dict.fromkeys(weights.keys(), "model.safetensors")


def hub_layout(
    model_args: ModelArgs, weights: dict[str, tuple], read: Callable[[str], torch.Tensor]
) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor]]:
    """The model's weights ({name: (dtype, shape)} and read(name)) in the layout of the files the model came
    from, for scripts/export.py: a name those files had stays; the others go through transformers' reverse
    conversion, as save_pretrained writes them (fused experts back into per-expert weights, Mixtral's mlp back
    into block_sparse_moe). Reads one model tensor at a time, and each once if the names are asked in order."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_args.hf_config)
    try:
        original = set(weight_map(model_args.folder))
    except (OSError, ValueError):  # no weights in the folder (a model trained from scratch): as save_pretrained
        original = set()

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: tensor} if name in original else revert_weight_conversion(model, {name: tensor})

    layout: dict[str, tuple] = {}
    source: dict[str, str] = {}  # a name in the files' layout -> the model's name it comes from
    for name, (dtype, shape) in weights.items():
        # On the meta device: the names and shapes, nothing read.
        for key, tensor in convert(name, torch.empty(shape, dtype=dtype, device="meta")).items():
            layout[key], source[key] = (dtype, tuple(tensor.shape)), name
    done: dict[str, dict[str, torch.Tensor]] = {}

    def read_converted(key: str) -> torch.Tensor:
        name = source[key]
        if name not in done:
            done.clear()  # one model tensor in memory at a time
            done[name] = convert(name, read(name))
        return done[name][key]

    return layout, read_converted


def save_run_tokenizer(spec: str, output: Path) -> None:
    """The tokenizer the run trained with, data.tokenizer (a folder or hub id), saved into `output` as transformers
    saves it, over the model folder's own; "" (the model's own, copied with its files): nothing to add."""
    if spec:
        from tokenizer import load_tokenizer

        load_tokenizer(spec).backend.save_pretrained(output)


def first_error(error: str | None) -> None:
    """Every rank raises the lowest rank's error together, if any rank had one."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise PretrainedLoadError(error)


def missing_or_unexpected(model: PreTrainedModel, folder: Path, names: dict[int, set[str]], loaded: set[str]):
    """The error if the files lack a weight of the model (tied weights: one of the names suffices), else None;
    rank 0 warns of weights the model does not use."""
    missing = [sorted(group)[0] for group in names.values() if not group & loaded]
    unexpected = sorted(loaded - {name for group in names.values() for name in group})
    if missing:
        # fully_shard renamed the model's class to FSDP<class>; the message names the one the user knows.
        model_class = type(model).__name__.removeprefix("FSDP")
        return (
            f"{folder} lacks {len(missing)} weight(s) of {model_class}, e.g. {missing[:3]}"
            + (f", and has others, e.g. {unexpected[:3]}" if unexpected else "")
            + "; its keys must be the model's state_dict() keys, or those transformers converts into them (e.g. "
            "per-expert MoE weights); its config.json must be the one the weights were saved with"
        )
    if unexpected and dist.get_rank() == 0:
        print(f"warning: {folder} has weights the model does not use: {unexpected[:5]}", flush=True)
    return None


def load_from_rank0(model: PreTrainedModel, folder: Path) -> None:
    """Rank 0 reads each safetensors file whole and broadcasts every tensor; each rank keeps its own shard. For
    a folder that only rank 0 sees; raises PretrainedLoadError on every rank together if rank 0 cannot read it."""
    rank = dist.get_rank()
    files, error = [], None
    if rank == 0:
        try:
            files = safetensors_files(folder)
        except (OSError, ValueError) as exc:
            error = f"cannot list the weights of {folder}: {exc}"
    # The other ranks learn the file names from rank 0 (on another node they may not see the folder).
    files = share_from_rank0(files, error)
    names = tensor_names(model)
    conversions = Conversions(model, names)
    tensors = {id(tensor): tensor for tensor, _ in state_names(model)}
    by_name = {name: tensors[key] for key, group in names.items() for name in group}
    # Rank 0: the model's tensors that transformers converts from several checkpoint tensors (per-expert weights),
    # each with its checkpoint keys in all the files; converted once rank 0 has read them all, then sent whole.
    groups: dict[str, list[tuple[str, str]]] = {}
    if rank == 0:
        try:
            keys = sorted(weight_map(folder), key=dot_natural_key)
        except Exception as exc:
            error, keys = f"cannot read the weights of {folder}: {type(exc).__name__}: {exc}", []
        for key in keys:
            name, pattern = conversions.model_key(key)
            if pattern is not None and name in by_name:
                groups.setdefault(name, []).append((key, pattern))
    share_from_rank0(None, error)
    pending: dict[str, torch.Tensor] = {}  # rank 0: checkpoint tensors read, waiting for the rest of their group
    # The files name an adapted layer's weight q_proj.weight; in the model it is q_proj.base_layer.weight.
    adapted = {unadapted(name): name for _, name in state_names(model) if ".base_layer." in name}
    loaded: set[str] = set()
    # strict=False: each file holds part of the weights; completeness is checked once all are loaded.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for file in files:
        state, error = {}, None
        if rank == 0:
            try:
                state = load_file(folder / file)
            except Exception as exc:
                error = f"cannot read {folder / file}: {type(exc).__name__}: {exc}"
            renamed = {key: conversions.model_key(key) for key in state}
            pending |= {key: state.pop(key) for key, (name, pattern) in renamed.items() if name in groups}
            state = {renamed[key][0]: tensor for key, tensor in state.items()}  # transformers' renamings
            for target in [target for target, sources in groups.items() if all(k in pending for k, _ in sources)]:
                if error is None:
                    converted, error = convert_whole(model, folder, target, groups.pop(target), pending, by_name,
                                                     conversions)  # fmt: skip
                    state |= converted
        share_from_rank0(None, error)
        loaded |= state.keys()
        state = {adapted.get(key, key): tensor for key, tensor in state.items()}
        # A collective: rank 0 sends the tensors one at a time; each rank copies out its own shard.
        set_model_state_dict(model, state, options=options)
        del state
    share_from_rank0(None, missing_or_unexpected(model, folder, names, loaded) if rank == 0 else None)


def convert_whole(
    model: PreTrainedModel,
    folder: Path,
    target: str,
    sources: list[tuple[str, str]],
    pending: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    conversions: Conversions,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Rank 0, reading every file whole: what transformers' converter makes of the checkpoint tensors `sources`
    (taken out of `pending`) for the model's `target`, whole tensors as from_pretrained makes them, or the error."""
    converter = conversions.converter(sources[0][1])
    error = expert_count_error(folder, target, sources, tensors[target], converter)
    for key, pattern in sources:
        part = functools.partial(read_part, pending.pop(key), None, 0, tensors[target].dtype)
        converter.add_tensor(target, key, pattern, part)
    if error is not None:
        return {}, error
    return run_converter(model, folder, converter, sources, tensors, whole=True)


def finish_pretrained(model: PreTrainedModel) -> None:
    """After the weights are in: transformers' init, which then writes only the non-persistent buffers."""
    # Mark what was loaded as initialised: transformers' init then writes only the non-persistent buffers.
    tensors = {id(tensor): tensor for tensor in model.state_dict(keep_vars=True).values()}.values()
    for tensor in tensors:
        tensor._is_hf_initialized = True
    run_hf_init(model)
    for tensor in tensors:
        del tensor._is_hf_initialized


class LoraTargetError(ValueError):
    """lora.target_modules names no module of the model."""


def add_lora_adapters(model: PreTrainedModel, rank: int, alpha: float, dropout: float, targets: list[str]) -> None:
    """LoRA adapters (peft) on the linear layers named in `targets`, added in place before sharding (on the meta
    device, like the model). peft freezes every other weight: only the adapters train and have optimizer state."""
    settings = PeftLoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    # For a message: read before peft, which may have adapted some layers when it fails on another.
    linears = sorted({name.rsplit(".", 1)[-1] for name, layer in model.named_modules() if type(layer) is nn.Linear})
    named = sorted({type(layer).__name__ for name, layer in model.named_modules()
                    if name.rsplit(".", 1)[-1] in targets and type(layer) is not nn.Linear})  # fmt: skip
    try:
        inject_adapter_in_model(settings, model)
    except ValueError as exc:  # peft's own names the problem, not the choices
        if isinstance(exc, NoMatchingPeftModuleError):
            raise LoraTargetError(
                f"lora.target_modules {targets} match no layer of the model; its linear layers are {linears}"
            ) from None
        # A module peft cannot adapt, e.g. a mixture-of-experts layer's fused experts: peft adapts those when the
        # targets name their projections as the checkpoint does (gate_proj, up_proj and down_proj, together).
        reason = f"they name {named}" if named else str(exc).strip().splitlines()[0]
        raise LoraTargetError(
            f"lora.target_modules {targets}: peft cannot adapt them ({reason}); its linear layers are {linears}, and "
            "fused experts are adapted through the names of their projections in the checkpoint (e.g. gate_proj, "
            "up_proj and down_proj together)"
        ) from None


def init_lora_adapters(model: PreTrainedModel, seed: int) -> None:
    """peft's initialisation of the sharded adapters: A Kaiming-uniform, B zero, so training starts from exactly the
    pretrained model. A is drawn as whole tensors from one generator, the same for any number of ranks."""
    torch.manual_seed(seed)
    with WholeTensorRandomFills():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.reset_lora_parameters("default", init_lora_weights=True)


def init_from_scratch(model: PreTrainedModel, seed: int) -> None:
    """The model's own random initialisation of every parameter and buffer, on the sharded model.

    The values are those of the whole tensors drawn from one generator seeded with `seed`, so they do not depend
    on the number of ranks, nor differ between the replicas of HSDP.
    """
    # Every rank seeds alike and draws every number of every tensor, in the same order; each keeps its part.
    torch.manual_seed(seed)
    with WholeTensorRandomFills():
        run_hf_init(model)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None and isinstance(module.weight, DTensor):
            # transformers zeroes weight[padding_idx], which does nothing on a sharded weight: zero the row
            # in the shard that holds it.
            weight = module.weight
            _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
            row = module.padding_idx - offset[0]
            if 0 <= row < weight.to_local().shape[0]:
                with torch.no_grad():
                    weight.to_local()[row].zero_()


# The in-place random fills (aten ops) behind torch.nn.init's random functions, and so transformers' init.
aten = torch.ops.aten
RANDOM_FILLS = {aten.normal_, aten.uniform_, aten.random_, aten.exponential_, aten.log_normal_, aten.cauchy_,
                aten.geometric_, aten.bernoulli_}  # fmt: skip


class WholeTensorRandomFills(TorchDispatchMode):
    """Random fills of sharded (DTensor) tensors draw the whole tensor, one block of rows at a time, and keep this
    rank's part (fill_by_blocks). DTensor's own random ops on a CPU mesh draw the same numbers in every shard, and
    seeding each rank apart makes the result depend on the number of ranks. Other ops need nothing: zero_, mul_,
    clamp_ ... do the same on a shard as on the whole tensor, and init functions that scale by the fan-in read
    the whole tensor's shape.

    Caught at the aten level (a dispatch mode sees ops before DTensor does), so that every torch.nn.init
    function is covered, whichever way it reaches the op. The alternative, initialising the whole model on rank 0
    and broadcasting it, needs the whole model in one rank's memory; this holds one block (INIT_BLOCK_ELEMENTS
    values) at a time, at the cost of every rank drawing every number (cheap next to training).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in RANDOM_FILLS and isinstance(args[0], DTensor):
            fill_by_blocks(args[0], lambda block: func(block, *args[1:], **kwargs))
            return args[0]
        return func(*args, **kwargs)


# Blocks of rows of at most this many values are drawn at a time.
INIT_BLOCK_ELEMENTS = 1 << 20


@torch.no_grad()
def fill_by_blocks(param: DTensor, fill: Callable[[torch.Tensor], object]) -> None:
    """Fill the whole tensor behind `param` block of rows by block of rows; keep this rank's part of each.

    The blocks depend only on the full shape, so every world size consumes the generator identically.
    """
    local = param.to_local()
    # Where this rank's part sits in the whole tensor, for any placement (FSDP, HSDP, TP).
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if param.ndim == 0:
        block = torch.empty((), dtype=param.dtype, device=local.device)
        fill(block)
        local.copy_(block)
        return
    rows, row_shape = param.shape[0], tuple(param.shape[1:])
    rows_per_block = max(1, INIT_BLOCK_ELEMENTS // max(1, math.prod(row_shape)))
    columns = tuple(slice(start, start + size) for start, size in zip(offset[1:], local_shape[1:], strict=True))
    for first in range(0, rows, rows_per_block):
        last = min(rows, first + rows_per_block)
        block = torch.empty((last - first, *row_shape), dtype=param.dtype, device=local.device)
        fill(block)
        low, high = max(first, offset[0]), min(last, offset[0] + local_shape[0])
        if low < high:
            local[low - offset[0] : high - offset[0]].copy_(block[(slice(low - first, high - first), *columns)])


def run_hf_init(model: PreTrainedModel) -> None:
    """transformers' initialize_weights: `_init_weights` on every module, skipping tensors flagged as initialised."""
    treat_as_library_code(model)
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)


def treat_as_library_code(model: PreTrainedModel) -> None:
    """fully_shard swapped the model's class for a subclass defined in torch, which transformers would take for
    remote code: its init would then skip modules without parameters of their own (e.g. GPT-2's scaled c_proj
    init), and its loading the model's conversion rules. That subclass answers as the model's own class does. A
    model fully_shard has not wrapped keeps transformers' own class, which needs nothing (and must not be patched:
    its is_custom_code would call itself)."""
    if not isinstance(model, FSDPModule):
        return
    original = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    type(model).is_custom_code = classmethod(lambda cls: original.is_custom_code())


def safetensors_files(folder: Path) -> list[str]:
    """The weight files of `folder`: those of model.safetensors.index.json, or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError("no model.safetensors or model.safetensors.index.json (other weight formats are not read)")


def state_names(model: nn.Module) -> Iterator[tuple[torch.Tensor, str]]:
    """Each tensor of the model with each of its names as state-dict functions take them: without the prefixes of
    torch.compile and activation-checkpoint wrappers around blocks. Tied weights are one tensor, several names."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        yield tensor, name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def tensor_names(model: nn.Module) -> dict[int, set[str]]:
    """The names of each tensor the checkpoint must provide; tied weights are one tensor with several names."""
    names: dict[int, set[str]] = {}
    for tensor, name in state_names(model):
        if ".lora_" in name:
            continue  # an adapter: not in the pretrained files (init_lora_adapters fills it)
        name = unadapted(name)
        names.setdefault(id(tensor), set()).add(name)
    return names


def unadapted(name: str) -> str:
    """The name of a weight before peft adapted its layer: peft moves an adapted layer's own weight one level down,
    to base_layer, once per adapter it wraps the layer in (fused experts: one for gate_up_proj, one for down_proj)."""
    return re.sub(r"(\.base_layer)+\.", ".", name)


def share_from_rank0(value: Any, error: str | None) -> Any:
    """Rank 0's `value`, on every rank; if rank 0 had an error, every rank raises it together."""
    shared = [value, error]
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        raise PretrainedLoadError(shared[1])
    return shared[0]


# ---- What train.py calls: every family's model.py provides these names (AGENTS.md: the model interface) ------

# The model's class, under the name every family gives it: whichever transformers class config.json names.
Model = PreTrainedModel


def build_model(config: Config) -> PreTrainedModel:
    """The model of config.model (its config.json) with LoRA adapters, with fp32 parameters: the
    sharded master weights, which mixed precision casts for compute. train.py calls it under torch.device("meta")."""
    model = AutoModelForCausalLM.from_config(config.model.hf_config, dtype=torch.float32)
    model.config.use_cache = False  # training never reuses past keys and values
    add_chunked_loss(model, config.training.loss_chunks)
    count_expert_tokens(model)
    lora = config.lora
    try:
        # Added before sharding, on the meta device too: fully_shard then shards adapters and frozen weights alike.
        add_lora_adapters(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    except LoraTargetError as exc:
        stop(str(exc))
    return model


# config.json keys of models whose logits are more than lm_head's output (Gemma 2/3 soft-capping, Cohere's and
# Granite's scales), with the value that means "nothing more".
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def add_chunked_loss(model: PreTrainedModel, loss_chunks: int) -> None:
    """model(tokens, targets=..., reduction=..., loss_chunks=N) returns the loss: the decoder's hidden states
    (the base model's forward), projected by lm_head chunk by chunk (chunked_loss.py), plus, in training, the
    router's load-balancing loss of a mixture-of-experts model whose config.json sets output_router_logits
    (router_loss). model(tokens) stays transformers' forward. It replaces forward on this instance (the weights and
    their names do not change) because the loss must run inside the root's __call__, where FSDP2 gathers lm_head's
    weight."""
    hf_forward = model.forward
    transforms = [key for key, plain in LOGIT_TRANSFORMS.items() if getattr(model.config, key, plain) != plain]
    if transforms and loss_chunks > 1 and dist.is_initialized() and dist.get_rank() == 0:
        print(f"warning: {type(model).__name__} transforms lm_head's logits ({', '.join(transforms)}): its loss is "
              "computed from its whole logits, training.loss_chunks does not apply", flush=True)  # fmt: skip
    balance = router_loss(model)

    @functools.wraps(hf_forward)
    def forward(*args, targets=None, reduction="mean", loss_chunks=1, **kwargs):
        if targets is None:
            return hf_forward(*args, **kwargs)
        if transforms:  # the model's own logits, whole
            output = hf_forward(*args, **kwargs)
            loss = chunked_cross_entropy(output.logits, nn.Identity(), targets, 1, reduction)
        else:
            output = model.base_model(*args, **kwargs)
            head = model.get_output_embeddings()
            loss = chunked_cross_entropy(output.last_hidden_state, head, targets, loss_chunks, reduction)
        if balance is None or not model.training:  # evaluation: the cross-entropy alone (perplexity)
            return loss
        return loss + balance(model, output.router_logits, targets, reduction)

    model.forward = forward


def router_loss(model: PreTrainedModel) -> Callable | None:
    """transformers' load-balancing loss of the router (Switch Transformer's: the model's own
    load_balancing_loss_func, x router_aux_loss_coef, as its forward adds it with labels), if config.json sets
    output_router_logits (else None: transformers adds none either). It is a mean over the micro-batch's tokens;
    the returned function weighs it like the cross-entropy: x the micro-batch's targets for reduction "sum", so that
    train.py's division by the step's targets makes the step's loss the mean cross-entropy + coef x the
    target-weighted mean of the balance losses (one micro-batch: exactly transformers' loss). It adds what it
    returns (no gradient) to model.router_loss_sums: [coef x balance loss x targets, targets], which
    balance_experts reports (moe_aux_loss) and clears. Stops with one line for a model that does not compute it
    as transformers' MoE models do."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    name = type(model).__name__
    function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    settings = [getattr(model, key, None) for key in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if function is None or None in settings:
        stop(f"{name}: its config.json sets output_router_logits, but the model has no load-balancing loss that "
             "this project adds (transformers' load_balancing_loss_func, num_experts, num_experts_per_tok, "
             "router_aux_loss_coef); set output_router_logits to false in its config.json")  # fmt: skip
    n_experts, top_k, coef = settings

    def balance(model: nn.Module, router_logits: tuple, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        # attention_mask None: every token counts, as in transformers' training on packed sequences.
        aux = coef * function(router_logits, n_experts, top_k)
        counted = (targets != IGNORE).sum()
        sums = torch.stack([aux.detach() * counted, counted.to(aux.dtype)])
        previous = getattr(model, "router_loss_sums", None)
        model.router_loss_sums = sums if previous is None else previous + sums
        return aux * counted if reduction == "sum" else aux

    return balance


# The functions of transformers' masking_utils that a model's forward calls to build its attention masks; with
# position_ids, no attention_mask and no cache, each detects packed documents (find_packed_sequence_indices: a
# position that does not follow the previous one starts a document) and masks attention across them.
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
# Layer kinds that attend through those masks; others (mamba, linear attention, convolutions) carry state across
# the documents of a row whatever the mask.
MASKED_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


class MaskBuilt(Exception):
    """Stops the probe's forward at its first mask, with the arguments the model gave it."""


def document_mask_error(model: PreTrainedModel, rows: int) -> str | None:
    """Why this model would attend across the documents packed in a row (micro-batches of `rows` rows), or None.

    A behavioural probe, not a list of models: the base model's own forward runs on the meta device (nothing
    computed) with a 2-document position_ids until it calls its mask builder; the builder is then run for real, on
    a 6-token CPU stand-in, with exactly the arguments the model gave it, and the mask must be block-diagonal. That
    catches models that do not pass position_ids to the builder (OPT, Bloom, MPT ...) and implementations with no
    mask (a kernel registered under another name). flex_attention is checked through sdpa's mask: both come from
    the same mask function (create_causal_mask), and building a BlockMask compiles (seconds on a CPU). Flash
    attention gets no mask: it finds the documents in position_ids itself, in micro-batches of one row only
    (modeling_flash_attention_utils._is_packed_sequence)."""
    config = model.config
    implementation = config._attn_implementation
    fix = (
        "use --data.document_mask false, or an attention implementation that masks documents "
        '("attn_implementation": "sdpa", "eager" or "flex_attention" in the model\'s config.json)'
    )
    name = type(model).__name__.removeprefix("FSDP")
    layers = set(getattr(config, "layer_types", None) or []) - MASKED_LAYERS
    if layers:
        return (f"data.document_mask: {name} has {', '.join(sorted(layers))} layers, which carry state across packed "
                "documents whatever the attention mask; use --data.document_mask false")  # fmt: skip
    if implementation.startswith("flash_attention"):
        if rows == 1:
            return None
        return (
            f"data.document_mask: {implementation} separates packed documents only in micro-batches of one row "
            f"(this run's have {rows}); {fix}, or one row per micro-batch (--training.grad_accum_steps)"
        )
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)  # two rows of two 3-token documents
    mask = first_mask(model, positions)
    if isinstance(mask, torch.Tensor):
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # eager's: 0 where allowed
        same_document = (positions[:, :, None] >= positions[:, None, :]) & BLOCKS
        if torch.equal(allowed, same_document.expand_as(allowed)):
            return None
    return (
        f"data.document_mask: {name} with attn_implementation {implementation} does not build transformers' "
        f"packed-sequence mask from position_ids, so packed documents would attend to each other; {fix}"
    )


# Which of the probe's 6 tokens may attend to which: the same 3-token document.
BLOCKS = torch.arange(6)[:, None] // 3 == torch.arange(6)[None, :] // 3


def first_mask(model: PreTrainedModel, positions: torch.Tensor) -> torch.Tensor | None:
    """The first attention mask the base model builds for `positions` (batch, seq) and no attention_mask: its
    forward runs on the meta device until it calls a mask builder, which then runs on CPU with the same arguments.
    None if the forward builds none, gives it no position_ids, or the builder returns none (sdpa skipped as plain
    causal, or an implementation masking_utils has no function for)."""
    module = sys.modules[type(model.base_model).__module__]
    builders = {builder: getattr(module, builder) for builder in MASK_BUILDERS if hasattr(module, builder)}
    calls = []

    def spy(builder: str) -> Callable:
        def record(*args, **kwargs):
            calls.append((builder, inspect.signature(builders[builder]).bind(*args, **kwargs).arguments))
            raise MaskBuilt

        return record

    try:
        for builder in builders:
            setattr(module, builder, spy(builder))
        model.base_model(input_ids=torch.zeros_like(positions, device="meta"), position_ids=positions.to("meta"))
    except Exception:  # MaskBuilt; anything else (a forward the meta device cannot run) proves no mask: refused
        pass
    finally:
        for builder, function in builders.items():
            setattr(module, builder, function)
    if not calls or calls[0][1].get("position_ids") is None:
        return None
    builder, arguments = calls[0]
    config = copy.copy(arguments["config"])
    if config._attn_implementation == "flex_attention":
        config._attn_implementation_internal = "sdpa"  # the same mask function, without compiling a BlockMask
    return builders[builder](**{**arguments, "config": config, "position_ids": positions,
                                "inputs_embeds": torch.zeros(*positions.shape, 1)})  # fmt: skip


def block_classes(model: PreTrainedModel, shard_modules: list[str]) -> list[str]:
    """The decoder layers, each fully_shard-ed on its own: the classes the model lists in _no_split_modules,
    unless parallel.shard_modules names others."""
    return shard_modules or sorted(model._no_split_modules)


def initialize(model: PreTrainedModel, config: Config, device: torch.device) -> None:
    """Fill the model after to_empty, sharded or plain (never fully_shard-ed): the pretrained weights, or the
    model's own random initialisation; both recompute the non-persistent buffers (rotary tables).
    Then the adapters' initialisation."""
    if not isinstance(model, FSDPModule):
        # to_empty gives each module of a plain model its own copy of a tied weight (lm_head and the embedding);
        # fully_shard keeps them one tensor. Tie them again before they are filled.
        model.tie_weights()
    if config.model.pretrained:
        try:
            load_pretrained(model, config.model.folder)
        except PretrainedLoadError as exc:
            stop(str(exc))
    else:
        init_from_scratch(model, seed=config.training.seed)
    init_lora_adapters(model, seed=config.training.seed)


def count_expert_tokens(model: PreTrainedModel) -> None:
    """Count, in training, the tokens each expert of each mixture-of-experts layer receives (for balance_experts):
    transformers' experts modules take the router's choice as forward(hidden_states, top_k_index, top_k_weights),
    and a hook adds it up in module.tokens_per_expert, on the device, without a host sync. (A block recomputed by
    activation checkpointing counts twice: every expert alike, which leaves the ratios reported unchanged.) Each
    such module keeps its place among them (moe_index) and the model their number and experts
    (expert_counts_shape), for balance_experts' rows. A module whose `counting` is False counts nothing."""

    def count(module: nn.Module, args: tuple, kwargs: dict, n_experts: int) -> None:
        if not module.training or not module.counting:
            return  # evaluation (no step's load)
        chosen = (args[1] if len(args) > 1 else kwargs["top_k_index"]).flatten()
        # One slot more: transformers' expert parallelism marks tokens of other ranks' experts with num_experts.
        counts = torch.zeros(n_experts + 1, device=chosen.device).index_add_(
            0, chosen, torch.ones_like(chosen, dtype=torch.float32)
        )[:-1]
        previous = getattr(module, "tokens_per_expert", None)
        module.tokens_per_expert = counts if previous is None else previous + counts

    experts = [
        module
        for module in model.modules()
        if "top_k_index" in inspect.signature(module.forward).parameters
        and isinstance(getattr(module, "num_experts", None), int)
    ]
    for index, module in enumerate(experts):
        # The count now: transformers' expert parallelism sets num_experts to this rank's experts, while the
        # router still chooses among all of them.
        module.register_forward_pre_hook(functools.partial(count, n_experts=module.num_experts), with_kwargs=True)
        module.moe_index, module.counting = index, True
    if experts:
        model.expert_counts_shape = (len(experts), max(module.num_experts for module in experts))


def balance_experts(model: PreTrainedModel, config: Config) -> dict[str, torch.Tensor]:
    """Called after each step's micro-batches and its optimizer step: the figures of a mixture-of-experts model for
    metrics.jsonl (device tensors; {} for a dense model). moe_load_max_mean / moe_load_min_mean: the most and least
    loaded expert's tokens over the mean, worst layer, every rank's tokens (1.0 = balanced; count_expert_tokens).
    With transformers' load-balancing loss (router_loss): moe_aux_loss, coef x the step's balance loss per target,
    the part of the logged loss that is not cross-entropy. transformers' routers have no bias to move."""
    shape = getattr(model, "expert_counts_shape", None)  # (MoE layers of the whole model, experts)
    router_sums = getattr(model, "router_loss_sums", None)
    if shape is None and router_sums is None:
        return {}
    layers = [module for module in model.modules() if getattr(module, "tokens_per_expert", None) is not None]
    # A row per MoE layer of the whole model, this rank's layers filled: the
    # sum over every rank fills each row with the tokens of the ranks that hold its layer.
    loads = torch.zeros(shape or (0, 0), device=next(model.parameters()).device)
    for layer in layers:
        loads[layer.moe_index, : len(layer.tokens_per_expert)] = layer.tokens_per_expert
    # One all-reduce for every figure.
    sums = torch.cat([loads.flatten()] + ([router_sums] if router_sums is not None else []))
    dist.all_reduce(sums)
    numbers = {}
    if shape is not None:
        loads = sums[: loads.numel()].view(shape)
        mean = loads.mean(dim=-1).clamp(min=1)
        numbers["moe_load_max_mean"] = (loads.max(dim=-1).values / mean).max()
        numbers["moe_load_min_mean"] = (loads.min(dim=-1).values / mean).min()
        for layer in layers:
            layer.tokens_per_expert = None
    if router_sums is not None:
        numbers["moe_aux_loss"] = sums[-2] / sums[-1].clamp(min=1)
        model.router_loss_sums = None
    return numbers


def output_logits(output: CausalLMOutputWithPast) -> torch.Tensor:
    """The logits (batch, seq, vocab_size) of model(tokens)."""
    return output.logits


def loss(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    reduction: str = "mean",
    chunks: int = 1,
) -> torch.Tensor:
    """The cross-entropy of the model on `tokens` against `targets` (batch, seq), in fp32 whatever the compute dtype,
    targets equal to IGNORE not counted; lm_head's logits computed in `chunks` sequence chunks (training.loss_chunks),
    one at a time, inside model(...) (add_chunked_loss). (train.py shifts the targets itself: the model gets no
    labels.)

    `positions` (batch, seq), restarting at 0 where each packed document starts, go in as position_ids with no
    attention_mask: transformers derives the documents from them and attends within each only (the packed-sequence
    mask; document_mask_error checks before training that this model and attention implementation build it).
    `document_ids` say the same thing, so they are not passed."""
    return model(tokens, position_ids=positions, targets=targets, reduction=reduction, loss_chunks=chunks)
