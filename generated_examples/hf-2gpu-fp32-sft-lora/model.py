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
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
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
from transformers.modeling_outputs import CausalLMOutputWithPast

from chunked_loss import chunked_cross_entropy
from errors import stop
from model_args import HUB_FILES, MODEL_RULES, RESUME_MAY_CHANGE, ModelArgs

if TYPE_CHECKING:  # config.py imports model_args.py, never this file: no import cycle, and no torch to read a config
    from config import Config

# The names train.py, preflight.py and the scripts import from every family's model.py (AGENTS.md lists them);
# HUB_FILES: the files of a hub model, which scripts/export.py copies.
__all__ = ["HUB_FILES", "MODEL_RULES", "RESUME_MAY_CHANGE", "Model", "ModelArgs", "block_classes", "build_model",
           "initialize", "loss", "output_logits"]  # fmt: skip


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
    loaded = set(with_model_keys(dict.fromkeys(shapes), model.base_model_prefix, names))
    error = missing_or_unexpected(model, folder, names, loaded)
    # The file's key for each tensor (the first of a tied group that the file has), and the model's tensor.
    state: dict[str, torch.Tensor] = {}
    chosen: set[int] = set()
    for key in sorted(shapes):
        name = key if key in by_name else f"{model.base_model_prefix}.{key}"
        tensor = tensors.get(by_name.get(name, -1))
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
            + "; its keys must match the model's state_dict() (checkpoints that transformers converts while "
            "loading, e.g. per-expert MoE weights, are not supported)"
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
    # The files name an adapted layer's weight q_proj.weight; in the model it is q_proj.base_layer.weight.
    adapted = {name.replace(".base_layer.", "."): name for _, name in state_names(model) if ".base_layer." in name}
    loaded: set[str] = set()
    # strict=False: each file holds part of the weights; completeness is checked once all are loaded.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for file in files:
        state, error = {}, None
        if rank == 0:
            try:
                state = with_model_keys(load_file(folder / file), model.base_model_prefix, names)
            except Exception as exc:
                error = f"cannot read {folder / file}: {type(exc).__name__}: {exc}"
        share_from_rank0(None, error)
        loaded |= state.keys()
        state = {adapted.get(key, key): tensor for key, tensor in state.items()}
        # A collective: rank 0 sends the tensors one at a time; each rank copies out its own shard.
        set_model_state_dict(model, state, options=options)
        del state
    share_from_rank0(None, missing_or_unexpected(model, folder, names, loaded) if rank == 0 else None)


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
    try:
        inject_adapter_in_model(settings, model)
    except ValueError:  # peft's own (NoMatchingPeftModuleError is one) names the problem, not the choices
        linears = sorted({name.rsplit(".", 1)[-1] for name, layer in model.named_modules() if type(layer) is nn.Linear})
        raise LoraTargetError(
            f"lora.target_modules {targets} match no layer of the model; its linear layers are {linears}"
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
    # fully_shard swapped the model's class for a subclass defined in torch, which transformers would take for
    # remote code and then skip modules without parameters of their own (e.g. GPT-2's scaled c_proj init).
    original = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    type(model).is_custom_code = classmethod(lambda cls: original.is_custom_code())
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)


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
        # peft moved an adapted layer's own weight one level down, to base_layer.
        name = name.replace(".base_layer.", ".")
        names.setdefault(id(tensor), set()).add(name)
    return names


def with_model_keys(state: dict[str, torch.Tensor], prefix: str, names: dict[int, set[str]]) -> dict:
    """`state` with keys saved from the base model (`layers.0...` for `model.layers.0...`) given the prefix."""
    known = {name for group in names.values() for name in group}
    return {key if key in known or f"{prefix}.{key}" not in known else f"{prefix}.{key}": t for key, t in state.items()}


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
    (the base model's forward), projected by lm_head chunk by chunk (chunked_loss.py). model(tokens) stays
    transformers' forward. It replaces forward on this instance (the weights and their names do not change)
    because the loss must run inside the root's __call__, where FSDP2 gathers lm_head's weight."""
    hf_forward = model.forward
    transforms = [key for key, plain in LOGIT_TRANSFORMS.items() if getattr(model.config, key, plain) != plain]
    if transforms and loss_chunks > 1 and dist.is_initialized() and dist.get_rank() == 0:
        print(f"warning: {type(model).__name__} transforms lm_head's logits ({', '.join(transforms)}): its loss is "
              "computed from its whole logits, training.loss_chunks does not apply", flush=True)  # fmt: skip

    @functools.wraps(hf_forward)
    def forward(*args, targets=None, reduction="mean", loss_chunks=1, **kwargs):
        if targets is None:
            return hf_forward(*args, **kwargs)
        if transforms:  # the model's own logits, whole
            return chunked_cross_entropy(hf_forward(*args, **kwargs).logits, nn.Identity(), targets, 1, reduction)
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        return chunked_cross_entropy(hidden, model.get_output_embeddings(), targets, loss_chunks, reduction)

    model.forward = forward


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
    """Fill the sharded model after to_empty: the pretrained weights, or the model's own random initialisation;
    both recompute the non-persistent buffers (rotary tables). Then the adapters' initialisation."""
    if config.model.pretrained:
        try:
            load_pretrained(model, config.model.folder)
        except PretrainedLoadError as exc:
            stop(str(exc))
    else:
        init_from_scratch(model, seed=config.training.seed)
    init_lora_adapters(model, seed=config.training.seed)


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
