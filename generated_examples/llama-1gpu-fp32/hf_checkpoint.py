"""The built-in Llama and Hugging Face transformers' `LlamaForCausalLM`: the one place that knows both namings.

- `args_from_hf_config` / `hf_config`: a checkpoint's config.json <-> ModelArgs (the shape keys of [model]).
- `to_hf_key` / `from_hf_key` and `to_hf` / `from_hf`: our parameter names and state dicts <-> transformers'.
- `save_hf_checkpoint` (checkpoint.save_format = "hf"): the sharded model written as a Hugging Face folder, each
  rank writing its own slices (DCP's HuggingFaceStorageWriter), consolidated into whole tensors.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # model_args.py reads config.json through this module: torch is imported where it is used
    import torch
    from torch import nn

    from model_args import ModelArgs

# The transformers classes whose weights and forward are this model's (names, shapes, rotary convention).
HF_ARCHITECTURES = ("LlamaForCausalLM",)
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


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint this model cannot take; the message names the problem and the fix."""


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


# The rotary scaling this model has (model.rope_type), and the keys of its parameters in a config.json's
# rope_parameters (transformers 5) or rope_scaling (transformers 4) -> ModelArgs'.
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                    "high_freq_factor": "rope_high_freq_factor",
                    "original_max_position_embeddings": "rope_original_max_seq_len"}  # fmt: skip


def rope_args(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary keys of [model] (rope_theta, rope_type and llama3's parameters) of a config.json, written by
    transformers 5 (rope_parameters) or 4 (rope_theta and rope_scaling, as Llama 3.1's hub files still are); any
    scaling but Llama 3.1/3.2's "llama3" ("linear", "yarn", "dynamic", ...) is refused: this model has no other."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise HFCheckpointError(
            f'its rotary embeddings use "{kind}" scaling, which the built-in llama does not have (it has '
            '"llama3"); train it with --family hf'
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(
            f"its rotary embeddings turn part of each head (partial_rotary_factor = {rope['partial_rotary_factor']}), "
            "the built-in llama's turn all of it; train it with --family hf"
        )
    args = {"rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))), "rope_type": kind}
    if kind == "llama3":
        missing = [key for key in LLAMA3_ROPE_KEYS if rope.get(key) is None]
        if missing:
            raise HFCheckpointError(
                f'its "llama3" rotary scaling has no {", ".join(missing)}; give them in config.json\'s '
                "rope_parameters (Llama 3.1's: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, "
                "original_max_position_embeddings 8192)"
            )
        args |= {ours: float(rope[key]) for key, ours in LLAMA3_ROPE_KEYS.items()}
        args["rope_original_max_seq_len"] = int(rope["original_max_position_embeddings"])
    return args


def hf_rope_parameters(args: ModelArgs) -> dict[str, Any]:
    """config.json's rope_parameters for `args` (what transformers 5's save_pretrained writes)."""
    rope = {"rope_theta": args.rope_theta, "rope_type": args.rope_type}
    if args.rope_type == "llama3":
        rope |= {key: getattr(args, ours) for key, ours in LLAMA3_ROPE_KEYS.items()}
    return rope


def args_from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The [model] keys of a LlamaForCausalLM config.json; HFCheckpointError for any other architecture or for
    options this model does not have (biases, another activation, a head size other than dim / n_heads)."""
    architectures = config.get("architectures") or [config.get("model_type", "an unnamed architecture")]
    if not set(architectures) & set(HF_ARCHITECTURES):
        raise HFCheckpointError(
            f"it is a {', '.join(map(str, architectures))}, not a {' or '.join(HF_ARCHITECTURES)}; the built-in "
            "llama takes Llama checkpoints only: train it with --family hf"
        )
    heads, dim = config["num_attention_heads"], config["hidden_size"]
    same = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "head_dim": dim // heads}
    unlike = [f"{key} = {config[key]}" for key, value in same.items() if config.get(key, value) != value]
    if unlike:
        raise HFCheckpointError(f"its {', '.join(unlike)} is not the built-in llama's; train it with --family hf")
    return {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "vocab_size": config["vocab_size"],
        "ffn_dim": config["intermediate_size"],
        "max_seq_len": config["max_position_embeddings"],
        **rope_args(config),
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def hf_config(args: ModelArgs, eos_id: int | None = None, bos_id: int | None = None) -> dict[str, Any]:
    """The config.json of LlamaForCausalLM for `args` (what LlamaConfig(...).save_pretrained writes)."""
    return {
        "architectures": list(HF_ARCHITECTURES),
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.ffn_dim,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": hf_rope_parameters(args),
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The config.json of a Hugging Face model folder; HFCheckpointError if there is none or it is not JSON."""
    path = Path(folder).expanduser() / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise HFCheckpointError(f"{path} does not exist; give a Llama folder written by save_pretrained") from None
    except json.JSONDecodeError as error:
        raise HFCheckpointError(f"{path} is not valid JSON ({error.msg}, line {error.lineno})") from None


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


def save_hf_folder(model: nn.Module, folder: Path, config: Any) -> None:
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


def save_hf_checkpoint(model: nn.Module, hf_dir: Path, step: int, config: Any) -> None:
    """checkpoint.save_format = "hf", at each checkpoint, on every rank: the model as hf_dir/step-N/ (written as
    step-N.tmp/, renamed once complete), the newest checkpoint.keep_last of them kept. Resume never reads them:
    it reads the checkpoints' own folders, which this does not touch."""
    import torch.distributed as dist

    from checkpoint_common import free_name

    staging, final = hf_dir / f"step-{step}.tmp", hf_dir / f"step-{step}"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed save's leftover: never complete
    dist.barrier()
    save_hf_folder(model, staging, config)
    if dist.get_rank() == 0:
        if final.exists():  # a folder of another save (a run resumed from an older checkpoint): kept beside
            final.rename(free_name(final, "replaced"))
        staging.rename(final)
        saved = sorted((p for p in hf_dir.glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        for old in saved[: -config.checkpoint.keep_last]:
            shutil.rmtree(old)
    dist.barrier()
