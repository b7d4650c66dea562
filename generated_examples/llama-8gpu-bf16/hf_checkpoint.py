"""The built-in Llama and Hugging Face transformers' `LlamaForCausalLM`: the one place that knows both namings
(hf_llama_config.py: their config.json <-> ModelArgs).

- `to_hf_key` / `from_hf_key` and `to_hf` / `from_hf`: our parameter names and state dicts <-> transformers'.
- `hf_layout`: the weights of a checkpoint under transformers' names, for scripts/export.py --format hf.
- `save_hf_folder` (checkpoint.save_format = "hf", checkpoint_common.save_hf_checkpoint): the sharded model
  written as a Hugging Face folder, each rank writing its own slices (DCP's HuggingFaceStorageWriter),
  consolidated into whole tensors.
- `write_hf_side_files`: config.json, generation_config.json and the tokenizer files of an exported folder, so
  that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` read it as it is.

Rotary embeddings need no permutation of the weights: this model turns the pairs (x[i], x[i + head_dim / 2]) of
each head (model.apply_rotary), as transformers' `rotate_half` does. (Meta's original Llama files turn adjacent
pairs (x[2i], x[2i + 1]); transformers' convert_llama_weights_to_hf permutes wq and wk into the half-split order,
which is the order of every Hugging Face Llama checkpoint and of this model.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from hf_llama_config import hf_config

if TYPE_CHECKING:  # torch is imported where it is used: scripts read configs without it
    from collections.abc import Callable

    import torch
    from torch import nn

    from config import Config
    from model_args import ModelArgs

# The tokenizer's files an exported folder carries when the model came from a Hugging Face folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")  # fmt: skip

# Ours -> transformers', per block (layers.{i}. -> model.layers.{i}.) and for the rest of the model.
BLOCK_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
MODEL_KEYS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}  # fmt: skip
HF_BLOCK_KEYS = {hf: ours for ours, hf in BLOCK_KEYS.items()}
HF_MODEL_KEYS = {hf: ours for ours, hf in MODEL_KEYS.items()}
BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def plain_name(name: str) -> str:
    """A parameter's name in the whole model: without the parts the wrappers of activation checkpointing and
    torch.compile add (layers.7._checkpoint_wrapped_module.attention.wq.weight -> layers.7.attention.wq.weight)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def to_hf_key(name: str) -> str:
    """Our parameter name -> transformers' LlamaForCausalLM key."""
    name = plain_name(name)
    block = BLOCK.fullmatch(name)
    if block and block.group(2) in BLOCK_KEYS:
        return f"model.layers.{block.group(1)}.{BLOCK_KEYS[block.group(2)]}"
    if name in MODEL_KEYS:
        return MODEL_KEYS[name]
    raise KeyError(f"{name} has no LlamaForCausalLM counterpart")


def from_hf_key(key: str) -> str:
    """transformers' LlamaForCausalLM key -> our parameter name."""
    block = HF_BLOCK.fullmatch(key)
    if block and block.group(2) in HF_BLOCK_KEYS:
        return f"layers.{block.group(1)}.{HF_BLOCK_KEYS[block.group(2)]}"
    if key in HF_MODEL_KEYS:
        return HF_MODEL_KEYS[key]
    raise KeyError(f"{key} is not a LlamaForCausalLM weight this model has")


def to_hf(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' (the same tensors, renamed); a tied output weight is left out, as
    transformers' own files leave out lm_head.weight."""
    hf = {to_hf_key(name): tensor for name, tensor in state.items()}
    if tie_embeddings:
        hf.pop("lm_head.weight", None)
    return hf


def from_hf(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """transformers' state dict -> ours (the same tensors, renamed); a tied model gets output.weight as the
    embedding's tensor, as our state dict lists it."""
    ours = {from_hf_key(key): tensor for key, tensor in state.items()}
    if tie_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def hf_layout(
    weights: dict[str, tuple], read: Callable[[str], torch.Tensor], tie_embeddings: bool
) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor]]:
    """Our weights ({name: (dtype, shape)} and read(name), one whole tensor at a time) under transformers' names,
    for a safetensors file from_pretrained loads as it is; a tied output weight left out, as transformers' own files
    leave it out."""
    layout: dict[str, tuple] = {}
    source: dict[str, tuple[str, int | None]] = {}  # key -> (our name, the expert's index or None)
    for name, (dtype, shape) in weights.items():
        if tie_embeddings and name == "output.weight":
            continue
        key = to_hf_key(name)
        layout[key], source[key] = (dtype, tuple(shape)), (name, None)
    held: dict[str, torch.Tensor] = {}

    def read_key(key: str) -> torch.Tensor:
        name, expert = source[key]
        if name not in held:
            held.clear()  # one of our tensors in memory at a time (the keys come in order)
            held[name] = read(name)
        return held[name] if expert is None else held[name][expert]

    return layout, read_key


def write_hf_side_files(out: Path, args: ModelArgs, tokenizer: str, hf_source: str = "") -> None:
    """Next to the exported weights: config.json and generation_config.json (LlamaForCausalLM's) and the
    tokenizer: every tokenizer file of the Hugging Face folder the model started from (`hf_source`), else
    data.tokenizer's tokenizer.json with a tokenizer_config.json naming its end-of-text token."""
    source = Path(hf_source).expanduser() if hf_source else None
    tokenizer_json = Path(tokenizer).expanduser() if tokenizer else None
    if tokenizer_json is not None and tokenizer_json.is_dir():
        tokenizer_json = tokenizer_json / "tokenizer.json"
    eos_id = bos_id = eos = None
    if tokenizer_json is not None and tokenizer_json.is_file():
        from tokenizer import load_tokenizer  # the project's own rules for the end-of-text token

        loaded = load_tokenizer(str(tokenizer_json))
        eos_id, eos = loaded.eos_id, loaded.backend.id_to_token(loaded.eos_id)
    if source is not None and (source / "config.json").is_file():
        original = json.loads((source / "config.json").read_text())
        eos_id, bos_id = original.get("eos_token_id", eos_id), original.get("bos_token_id")
    (out / "config.json").write_text(json.dumps(hf_config(args, eos_id, bos_id), indent=2) + "\n")
    copied = []
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
                copied.append(name)
    if "tokenizer.json" not in copied and tokenizer_json is not None and tokenizer_json.is_file():
        shutil.copyfile(tokenizer_json, out / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if "generation_config.json" not in copied:
        generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "_from_model_config": True}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def save_hf_folder(model: nn.Module, folder: Path, config: Config) -> None:
    """Write the model (sharded or not; under pipeline parallelism, this rank's part, named as in the whole model)
    as a Hugging Face LlamaForCausalLM folder, on every rank together: each rank writes the slices of its shards under
    transformers' names (DCP's HuggingFaceStorageWriter), which are then consolidated into whole tensors in
    safetensors files; rank 0 adds config.json, generation_config.json and the tokenizer's files."""
    import torch.distributed as dist
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = {to_hf_key(name): param.detach() for name, param in model.named_parameters()}
    writer = HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    if dist.get_rank() == 0:
        shutil.rmtree(folder / "sharded", ignore_errors=True)  # the per-rank slices, now consolidated
        write_hf_side_files(folder, config.model, config.data.tokenizer)
    dist.barrier()
