"""What a Hugging Face config.json must say for the built-in Llama to take it, and the config.json of ours.

- `args_from_hf_config` (and `rope_args`, its rotary part): a LlamaForCausalLM config.json -> the shape keys of
  [model], or HFCheckpointError naming what this model does not have (another architecture, biases, rotary
  scaling other than "llama3", ...).
- `hf_config`: ModelArgs -> the config.json of LlamaForCausalLM (what save_pretrained writes).

Standard library only, and no import of this project: `fsdp2gen new --family llama --hf-model DIR` runs this
very file on DIR's config.json (fsdp2gen never imports torch), so a checkpoint is refused with the same line
when the project is generated as when it is trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model_args import ModelArgs

# The transformers classes whose weights and forward are this model's (names, shapes, rotary convention).
HF_ARCHITECTURES = ("LlamaForCausalLM",)


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint this model cannot take; the message names the problem and the fix."""


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
    # transformers 5 keeps partial_rotary_factor in rope_parameters, older configs beside them.
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFCheckpointError(
            f"its rotary embeddings turn part of each head (partial_rotary_factor = {partial}), the built-in "
            "llama's turn all of it; train it with --family hf"
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
