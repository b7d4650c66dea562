"""`fsdp2gen plan` for the hf family: a Hugging Face model's shapes read from its config.json, LoRA adapters as the
trainable subset, and the project's task (pretrain or sft).

No torch and no transformers (the generator imports neither): config.json is parsed as JSON, and the parameters
are written down as transformers' Llama, Qwen2, Qwen3 and Mistral classes build them (tests/test_plan_families.py
builds each on the meta device and compares every name and shape). A block's saved activations
(hf_block_activation_bytes) and LoRA's change of them (lora_activation_delta) are counted op by op as
transformers' blocks save them, which the same tests measure.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from fsdp2gen.questions import template_dir
from fsdp2gen.sizes import LlamaShape

FP32 = 4
INT32, INT64 = 4, 8

# The config.json keys plan needs from every model, and their bounds (plan.MODEL_LIMITS' for the same sizes).
REQUIRED = {
    "hidden_size": 2**17,
    "intermediate_size": 2**20,
    "num_hidden_layers": 2**12,
    "num_attention_heads": 2**12,
    "vocab_size": 2**22,
}
NO_LIMIT_OF_POSITIONS = 2**31  # model_args.py's max_seq_len of a model without max_position_embeddings


@dataclass(frozen=True)
class Architecture:
    """How transformers builds one model_type: the defaults of the keys config.json may leave out (the config
    class's own) and which linear layers carry a bias."""

    num_key_value_heads: int | None  # None: as many as num_attention_heads
    head_dim: int | None  # None: hidden_size // num_attention_heads
    qkv_bias: bool | None  # None: config.json's attention_bias (default False); else fixed by the class
    o_bias: bool | None  # as qkv_bias
    mlp_bias: bool  # whether config.json's mlp_bias is read (default False)
    qk_norm: bool  # per-head RMSNorm of q and k (Qwen3): q_norm and k_norm weights of head_dim


ARCHITECTURES = {
    "llama": Architecture(None, None, qkv_bias=None, o_bias=None, mlp_bias=True, qk_norm=False),
    "qwen2": Architecture(32, None, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": Architecture(32, 128, qkv_bias=None, o_bias=None, mlp_bias=False, qk_norm=True),
    "mistral": Architecture(8, None, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3_moe": Architecture(4, None, qkv_bias=None, o_bias=None, mlp_bias=False, qk_norm=True),
    "mixtral": Architecture(8, None, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
}


@dataclass(frozen=True)
class Experts:
    """How transformers builds the mixture-of-experts blocks of one model_type: a router (mlp.gate, n_experts x
    hidden_size) and the experts fused into two tensors per block (mlp.experts.gate_up_proj, n_experts x 2 hidden
    x hidden_size; mlp.experts.down_proj, n_experts x hidden_size x hidden), run by its grouped-GEMM experts
    implementation (the default), with the config keys that size them and the config class's defaults."""

    count: int  # the number of experts' default (config.json's num_local_experts, or num_experts: attribute_map)
    hidden: tuple[str, int | None]  # each expert's hidden size: its key and default (None: required)
    top_k: int  # num_experts_per_tok's default
    router_first: bool  # named_parameters() order: mlp.gate before mlp.experts (Mixtral) or after (Qwen3-MoE)
    sparse_step: bool  # decoder_sparse_step and mlp_only_layers pick the MoE blocks (Qwen3-MoE); else all are
    fp32_weights: bool  # the router's top-k weights stay fp32 (Mixtral) or are cast to the compute dtype (Qwen3-MoE)


# The mixture-of-experts model types plan derives (Qwen3-MoE: Qwen3-30B-A3B, 235B-A22B; Mixtral 8x7B, 8x22B). Other
# transformers MoE models differ in what this does not model: shared experts (qwen2_moe, deepseek, glm4_moe),
# full-width q/k norms (olmoe, minimax_m2), biases and sinks (gpt_oss, phimoe), latent attention (deepseek).
EXPERTS = {  # fmt: skip
    "qwen3_moe": Experts(
        128, ("moe_intermediate_size", 768), 8, router_first=False, sparse_step=True, fp32_weights=False
    ),
    "mixtral": Experts(8, ("intermediate_size", None), 2, router_first=True, sparse_step=False, fp32_weights=True),
}
# The linear layers of a decoder block, the ones lora.target_modules may name.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class HfConfigError(ValueError):
    """A config.json plan cannot read; plan.py turns it into a PlanError (one line, exit code 2)."""


@dataclass(frozen=True)
class LoraSpec:
    """config.toml's [lora]: peft's adapters A (rank x in) and B (out x rank) on every linear layer named in
    target_modules; the model's own weights are frozen."""

    rank: int
    targets: tuple[str, ...]
    dropout: float = 0.0
    # QLoRA (a --qlora project): the adapted layers' frozen weights are stored in NF4 (nf4_bytes_per_value).
    nf4: bool = False


@dataclass(frozen=True)
class HfShape(LlamaShape):
    """A Hugging Face decoder as plan sees it: the llama shape fields (dim = hidden_size, ffn_dim =
    intermediate_size, ...) plus what transformers builds differently."""

    source: str = ""  # the model's folder or config.json
    model_type: str = "llama"
    explicit_head_dim: int = 0  # config.json's head_dim (may differ from hidden_size // num_attention_heads)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    lora: LoraSpec | None = None
    # A mixture-of-experts model (EXPERTS): the blocks whose MLP is routed (the llama fields n_experts, top_k and
    # moe_ffn_dim size them); the router's top-k weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's
    # norm_topk_prob).
    sparse_layers: tuple[int, ...] = ()
    normalises_top_k: bool = False

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.sparse_layers


def read_hf_config(path: Path) -> HfShape:
    """The shape of the model whose config.json is `path` (or a folder holding one)."""
    file = path / "config.json" if path.is_dir() else path
    fix = "pass a model folder with config.json (save_pretrained writes one) or its config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HfConfigError(f"{file} not found; {fix}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise HfConfigError(f"{file}: cannot read ({error}); {fix}") from None
    except json.JSONDecodeError as error:
        raise HfConfigError(f"{file}: invalid JSON ({error}); {fix}") from None
    except RecursionError:
        raise HfConfigError(f"{file}: nested too deeply to read; {fix}") from None
    if not isinstance(raw, dict):
        raise HfConfigError(f"{file}: not a JSON object; {fix}")
    return hf_shape(raw, str(file))


def _number(config: dict[str, Any], source: str, key: str, default: int | None, limit: int) -> int:
    """config.json's int `key`, from 1 to `limit`; `default` when left out (None: required)."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise HfConfigError(f"{source}: {key} missing; plan needs it to derive the parameter shapes, add it")
    if type(value) is not int or not 1 <= value <= limit:
        raise HfConfigError(f"{source}: {key} must be an int from 1 to {limit}, got {value!r}; fix config.json")
    return value


def _flag(config: dict[str, Any], source: str, key: str, default: bool) -> bool:
    """config.json's bool `key`, `default` when left out."""
    value = config.get(key, default)
    if type(value) is not bool:
        raise HfConfigError(f"{source}: {key} must be true or false, got {value!r}; fix config.json")
    return value


def hf_shape(config: dict[str, Any], source: str) -> HfShape:
    """config.json's keys as transformers reads them, with its config class's defaults for those left out."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HfConfigError(
            f"{source}: model_type {model_type!r}: plan derives the parameter shapes of "
            f"{', '.join(ARCHITECTURES)} models only; plan a similar model with --size or --hf-config"
        )
    arch = ARCHITECTURES[model_type]

    def number(key: str, default: int | None, limit: int) -> int:
        return _number(config, source, key, default, limit)

    def flag(key: str, default: bool) -> bool:
        return _flag(config, source, key, default)

    sizes = {key: number(key, None, limit) for key, limit in REQUIRED.items()}
    heads = sizes["num_attention_heads"]
    kv_heads = number("num_key_value_heads", arch.num_key_value_heads or heads, 2**12)
    head_dim = number("head_dim", arch.head_dim or sizes["hidden_size"] // heads, 2**14)
    if heads % kv_heads:
        raise HfConfigError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}); "
            "fix config.json"
        )
    attention_bias = flag("attention_bias", False)
    experts = _experts(config, source, model_type, sizes["num_hidden_layers"])
    return HfShape(
        dim=sizes["hidden_size"],
        n_layers=sizes["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=sizes["intermediate_size"],
        vocab_size=sizes["vocab_size"],
        max_seq_len=number("max_position_embeddings", NO_LIMIT_OF_POSITIONS, NO_LIMIT_OF_POSITIONS),
        tie_embeddings=flag("tie_word_embeddings", False),
        source=source,
        model_type=model_type,
        explicit_head_dim=head_dim,
        qkv_bias=attention_bias if arch.qkv_bias is None else arch.qkv_bias,
        o_bias=attention_bias if arch.o_bias is None else arch.o_bias,
        mlp_bias=flag("mlp_bias", False) if arch.mlp_bias else False,
        qk_norm=arch.qk_norm,
        **experts,
    )


def _experts(config: dict[str, Any], source: str, model_type: str, layers: int) -> dict[str, Any]:
    """The HfShape fields of a mixture-of-experts config.json (EXPERTS), none for a dense model type. Qwen3-MoE's
    block i is routed unless listed in mlp_only_layers, when (i + 1) is a multiple of decoder_sparse_step."""
    spec = EXPERTS.get(model_type)
    if spec is None:
        return {}
    # transformers 5 writes num_local_experts and reads num_experts (the hub's Qwen3-MoE files) as the same key.
    key = "num_local_experts" if config.get("num_local_experts") is not None else "num_experts"
    count = _number(config, source, key, spec.count, 2**16)
    top_k = _number(config, source, "num_experts_per_tok", spec.top_k, 2**16)
    hidden = _number(config, source, spec.hidden[0], spec.hidden[1], 2**20)
    if top_k > count:
        raise HfConfigError(f"{source}: num_experts_per_tok ({top_k}) must be at most {key} ({count}); fix config.json")
    sparse = range(layers)
    normalises = True
    if spec.sparse_step:
        step = _number(config, source, "decoder_sparse_step", 1, 2**12)
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(type(i) is int for i in dense):
            raise HfConfigError(
                f"{source}: mlp_only_layers must be a list of block indices, got {dense!r}; fix config.json"
            )
        sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        normalises = _flag(config, source, "norm_topk_prob", False)
    return {"n_experts": count, "top_k": top_k, "moe_ffn_dim": hidden, "sparse_layers": tuple(sparse),
            "normalises_top_k": normalises}  # fmt: skip


# The dimension a tensor-parallel plan word splits a layer's weight on, as the project's tensor_parallel.py
# translates the word into torch's styles: 0 (Colwise: output features; an embedding's vocabulary rows), 1
# (Rowwise: input features; a bias stays whole), None (the weight stays whole on every tp rank). A word not listed
# is one the project stops on (tensor_parallel.py's torch_style), and plan refuses.
TP_SPLIT_DIM = {"colwise": 0, "colwise_gather_output": 0, "colwise_rep": 0, "rowwise": 1, "rowwise_rep": 1,
                "rowwise_split_input": 1, "embedding_rowwise": 0, "embedding_colwise": 1,
                "replicated_with_grad_allreduce": None, "sequence_parallel": None, "replicate": None}  # fmt: skip


@cache
def declared_tp_plan(model_type: str) -> dict[str, str]:
    """The tensor-parallel plan the model type declares (its config class's base_model_tp_plan: {module pattern
    relative to the base model, "*" for a layer index: word}), as templates/hf_plans.json records it from the
    installed transformers (scripts/hf_plans.py); {} where none is declared or the type is not listed."""
    plans = json.loads((template_dir() / "hf_plans.json").read_text())["models"]
    return dict(plans.get(model_type, {}).get("tp_plan", {}))


def tp_split_dim(model: HfShape, name: str) -> int | None:
    """The dimension tensor parallelism splits parameter `name` on (TP_SPLIT_DIM), from the model's declared plan;
    lm_head is split by vocabulary (the project keeps the logits split for loss_parallel, whatever its word). The
    model's plan is its config's plus, unless that names them, the input embeddings as "embedding_rowwise"
    (transformers' PreTrainedModel.init_parallel_plans adds them to every model with a plan and embed_tokens), which
    the project's tensor_parallel.py splits by the embedding dimension instead ("embedding_colwise": DTensor's
    backward of a lookup split by rows makes the whole gradient on every tp rank) unless lm_head shares the weight.
    A layer peft adapted (its `base_layer`, `lora_A.<adapter>`, `lora_B.<adapter>`) splits as the project's
    tensor_parallel.py lora_styles splits it: base_layer as the plan says the layer; with output features split
    (colwise) lora_B too and lora_A whole, with input features split (rowwise) lora_A too and lora_B whole."""
    module = name.rsplit(".", 1)[0]
    adapted = re.fullmatch(r"(.+)\.(base_layer|lora_A|lora_B)(\.[^.]+)?", module)
    if adapted:
        dim = tp_split_dim(model, adapted[1] + ".weight")
        return {"base_layer": dim, "lora_A": 1 if dim == 1 else None, "lora_B": 0 if dim == 0 else None}[adapted[2]]
    if module == "lm_head":
        return 0
    plan = {"embed_tokens": "embedding_rowwise"} | declared_tp_plan(model.model_type)
    for pattern, word in plan.items():
        if re.fullmatch(r"[^.]+".join(re.escape(part) for part in pattern.split("*")), module.removeprefix("model.")):
            untied_embedding = word == "embedding_rowwise" and not model.tie_embeddings
            return TP_SPLIT_DIM["embedding_colwise" if untied_embedding else word]
    return None


def tp_unsupported(model: HfShape) -> str | None:
    """Why plan cannot plan tensor parallelism of `model` (the problem, for a line naming the fix), or None."""
    plan = declared_tp_plan(model.model_type)
    if not plan:
        return f"{model.model_type} declares no tensor-parallel plan (its config class's base_model_tp_plan is empty)"
    odd = sorted({word for word in plan.values() if word not in TP_SPLIT_DIM})
    if odd:
        return f"{model.model_type}'s tensor-parallel plan uses {', '.join(odd)}, which the project does not translate"
    if model.tie_embeddings and tp_split_dim(model, "model.embed_tokens.weight") != 0:
        return f"{model.model_type}'s plan splits its tied input and output embeddings differently"
    return None


def hf_parameter_shapes(model: HfShape, tp: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """hf_parameter_shapes_whole's parameters, each as its tensor-parallel rank holds it (tp_split_dim): the
    weights the model's declared plan splits hold ceil(1/tp) of the split dimension."""
    shapes = hf_parameter_shapes_whole(model)
    if tp == 1:
        return shapes
    split = []
    for name, shape in shapes:
        dim = tp_split_dim(model, name)
        if dim is not None and dim < len(shape):
            shape = shape[:dim] + (math.ceil(shape[dim] / tp),) + shape[dim + 1 :]
        split.append((name, shape))
    return split


def hf_parameter_shapes_whole(model: HfShape) -> list[tuple[str, tuple[int, ...]]]:
    """model.named_parameters() of AutoModelForCausalLM.from_config(config.json), peft's adapters included:
    an adapted layer's own weight moves to `base_layer`, then come lora_A (rank x in) and lora_B (out x rank)."""
    d, hd = model.dim, model.head_dim
    linears = {
        "self_attn.q_proj": (model.n_heads * hd, d, model.qkv_bias),
        "self_attn.k_proj": (model.n_kv_heads * hd, d, model.qkv_bias),
        "self_attn.v_proj": (model.n_kv_heads * hd, d, model.qkv_bias),
        "self_attn.o_proj": (d, model.n_heads * hd, model.o_bias),
        "mlp.gate_proj": (model.ffn_dim, d, model.mlp_bias),
        "mlp.up_proj": (model.ffn_dim, d, model.mlp_bias),
        "mlp.down_proj": (d, model.ffn_dim, model.mlp_bias),
    }
    lora = model.lora
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (model.vocab_size, d))]
    for i in range(model.n_layers):
        routed = i in model.moe_layers
        for name, (rows, cols, bias) in linears.items():
            if routed and name.startswith("mlp."):
                continue
            full = f"model.layers.{i}.{name}"
            adapted = lora is not None and lora_targets(full, lora.targets)
            own = full + (".base_layer" if adapted else "")
            shapes.append((own + ".weight", (rows, cols)))
            if bias:
                shapes.append((own + ".bias", (rows,)))
            if adapted:
                shapes += [(full + ".lora_A.default.weight", (lora.rank, cols))]
                shapes += [(full + ".lora_B.default.weight", (rows, lora.rank))]
            if name == "self_attn.o_proj" and model.qk_norm:
                shapes += [(f"model.layers.{i}.self_attn.{n}.weight", (hd,)) for n in ("q_norm", "k_norm")]
        shapes += expert_shapes(model, i) if routed else []
        shapes += [(f"model.layers.{i}.{n}.weight", (d,)) for n in ("input_layernorm", "post_attention_layernorm")]
    shapes.append(("model.norm.weight", (d,)))
    if not model.tie_embeddings:
        shapes.append(("lm_head.weight", (model.vocab_size, d)))
    return shapes


def expert_shapes(model: HfShape, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """A routed block's MLP as transformers builds it (EXPERTS): the router and the fused experts."""
    mlp, e, h = f"model.layers.{layer}.mlp.", model.n_experts, model.moe_ffn_dim
    router = [(mlp + "gate.weight", (e, model.dim))]
    experts = [(mlp + "experts.gate_up_proj", (e, 2 * h, model.dim)), (mlp + "experts.down_proj", (e, model.dim, h))]
    return router + experts if EXPERTS[model.model_type].router_first else experts + router


# torchao's NF4 (a --qlora project's nf4.py): 4 bits per value, an int8 scale per 64 values and an fp32 factor per
# 256 scales: 4 + 8/64 + 32/16384 bits.
NF4_BYTES = (4 + 8 / 64 + 32 / 16384) / 8
# The transient bytes per value of dequantizing one NF4 weight for its matmul (torchao's get_original_weight: the
# 4-bit codes as int64, the fp32 values and scales, stacked, then the compute-dtype copy), measured on CPU with
# torchao 0.18: 20.7 for bf16 and fp32 alike.
NF4_DEQUANTIZE_BYTES = 21


def is_nf4(model: LlamaShape, name: str) -> bool:
    """Whether parameter `name` is stored in NF4: an adapted layer's frozen weight in a QLoRA project."""
    lora = model.lora if isinstance(model, HfShape) else None
    return lora is not None and lora.nf4 and name.endswith(".base_layer.weight")


def lora_targets(module: str, targets: tuple[str, ...]) -> bool:
    """peft's match of a list of target_modules: the module's name is a target or ends with '.' + a target."""
    return any(module == target or module.endswith("." + target) for target in targets)


def is_trainable(model: LlamaShape, name: str) -> bool:
    """Whether a parameter has a gradient and optimizer state: with LoRA the adapters only, else every one."""
    return not isinstance(model, HfShape) or model.lora is None or ".lora_" in name


def hf_block_activation_bytes(model: HfShape, batch: int, seq_len: int, compute: int, layer: int = 0) -> int:
    """Bytes one transformers decoder block saves for backward (its input included, cos and sin not: the model
    computes them once per forward), as tests/test_plan_families.py measures them. Per token: each RMSNorm keeps
    its input in fp32 (the input itself in fp32, else one fp32 copy) and its normalised output in the compute
    dtype, and an fp32 rsqrt; the rotated q, k, v and the attention output (n_heads x head_dim wide, which need
    not be hidden_size) and attention's fp32 logsumexp; the inputs of q/k/v and of gate/up; the MLP's gate output,
    silu output, up output and down_proj's input. Qwen3's q_norm and k_norm are RMSNorms too, per head.

    The llama family's block_activation_bytes differs in mixed precision only: its model.py keeps two fp32 copies
    per norm and casts fp32 cos/sin in every block."""
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    per_token = 2 * ((FP32 + compute) * model.dim + FP32)  # the two norms
    per_token += compute * (2 * q + 2 * kv) + FP32 * model.n_heads  # attention
    per_token += compute * 2 * model.dim  # the inputs of q/k/v and of gate/up (a routed block: the router's)
    if model.qk_norm:
        per_token += (FP32 + compute) * (q + kv) + FP32 * (model.n_heads + model.n_kv_heads)
    if layer in model.moe_layers:
        return batch * seq_len * per_token + sum(routed_activation_parts(model, batch * seq_len, compute).values())
    return batch * seq_len * (per_token + 4 * compute * model.ffn_dim)  # the MLP


def routed_activation_parts(model: HfShape, tokens: int, compute: int) -> dict[str, int]:
    """What one routed MLP (EXPERTS: the router and transformers' grouped-GEMM experts) saves for backward for
    `tokens` tokens, by part (its input, the normalised tokens, is the block's: the router's matmul keeps it), as
    tests/test_plan_families.py measures it. Each token goes to top_k experts: tokens x top_k routed copies.

    - router: the softmax over all experts (fp32); the top-k weights the experts' output is scaled by (compute
      dtype; Mixtral's stay fp32); renormalised to sum to 1 (Mixtral, norm_topk_prob), the division keeps the
      fp32 weights and their sum;
    - indices: the chosen experts (topk), the copies' order by expert and its inverse (the gathers), the token of
      each copy (int64 each), and the grouped GEMM's offsets (int32, one per expert);
    - routed copies: the tokens gathered in expert order, the experts' input (compute dtype);
    - expert hidden: per copy the gate_up projection's output (2 x hidden), the activation's output and the
      product (hidden each);
    - expert outputs: down_proj's output per copy (dim), kept by the multiplication by the weights.
    Balanced routing or not, the same tensors: only the number of copies per expert changes.
    """
    routed, spec = tokens * model.top_k, EXPERTS[model.model_type]
    weights = (FP32 if spec.fp32_weights else compute) * routed
    if model.normalises_top_k:
        weights += FP32 * (routed + tokens)
    return {
        "router": FP32 * tokens * model.n_experts + weights,
        "indices": INT64 * 4 * routed + INT32 * model.n_experts,
        "routed copies": compute * routed * model.dim,
        "expert hidden": 4 * compute * routed * model.moe_ffn_dim,
        "expert outputs": compute * routed * model.dim,
    }


def hf_block_with_lora_bytes(model: HfShape, batch: int, seq_len: int, compute: int, layer: int) -> int:
    """hf block `layer`'s saved activations (hf_block_activation_bytes) with LoRA's change (lora_activation_delta)."""
    return hf_block_activation_bytes(model, batch, seq_len, compute, layer) + lora_activation_delta(
        model, batch, seq_len, compute, layer
    )


def lora_activation_delta(model: HfShape, batch: int, seq_len: int, compute: int, layer: int = 0) -> int:
    """How LoRA changes one block's saved activations (bytes, negative when it saves less), as torch saves them
    (tests/test_plan_families.py measures it on a transformers block):

    - a frozen matmul keeps its weight (for the input's gradient) but not its input; a frozen RMSNorm weight's
      multiply does not keep the normalised input (compute dtype; Qwen3's q_norm and k_norm too). So the input
      of q/k/v (the attention norm's output), of gate/up (the MLP norm's output) and of down_proj is kept only
      while one of them is adapted; o_proj's input, the attention output, is kept by the attention kernel anyway;
    - an adapted layer's lora_A keeps that same input, lora_B keeps lora_A's output (tokens x rank);
    - with dropout > 0, lora_A keeps its own dropped-out copy of the input instead, and dropout its mask (bool);
    - a routed block (`layer` in moe_layers; its experts frozen: read_lora adapts attention only there): the frozen
      router keeps no input either, and the frozen grouped GEMMs not theirs, the routed copies and the products
      (tokens x top_k x (dim + moe_ffn_dim)), in place of down_proj's input.
    """
    lora = model.lora
    if lora is None:
        return 0
    tokens = batch * seq_len
    widths = {"q_proj": model.dim, "k_proj": model.dim, "v_proj": model.dim, "o_proj": model.n_heads * model.head_dim,
              "gate_proj": model.dim, "up_proj": model.dim, "down_proj": model.ffn_dim}  # fmt: skip
    paths = {name: f"model.layers.0.{'self_attn' if name in ATTENTION else 'mlp'}.{name}" for name in widths}
    adapted = [name for name in widths if lora_targets(paths[name], lora.targets)]
    delta = compute * tokens * (lora.rank * len(adapted) - 2 * model.dim)  # lora_A outputs; both norms' outputs
    if model.qk_norm:  # q_norm's and k_norm's frozen weights: their normalised inputs are not kept either
        delta -= compute * tokens * (model.n_heads + model.n_kv_heads) * model.head_dim
    # The inputs the full model keeps for its weights' gradients, shared by the layers that read them.
    for readers, width in ((("q_proj", "k_proj", "v_proj"), model.dim), (("gate_proj", "up_proj"), model.dim),
                           (("down_proj",), model.ffn_dim)):  # fmt: skip
        if lora.dropout > 0 or not set(readers) & set(adapted):
            delta -= compute * tokens * width
    if lora.dropout > 0:
        delta += (compute + 1) * tokens * sum(widths[name] for name in adapted)
    if layer in model.moe_layers:
        delta += compute * tokens * (model.ffn_dim - model.top_k * (model.dim + model.moe_ffn_dim))
    return delta


# A decoder block's linear layers in the order its forward calls them (transformers' Llama, Qwen2/3, Mistral).
FORWARD_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_op_level_delta(model: HfShape, batch: int, seq_len: int, compute: int) -> int:
    """How LoRA changes the matmul outputs one block keeps under op-level selective AC (activation_checkpoint.py
    keeps every second matmul's output, counted in forward order), in bytes.

    An adapted layer runs three matmuls (peft: the frozen base layer's, then lora_A's, tokens x rank, then
    lora_B's, as wide as the base's): the alternation then keeps lora_B's output beside the base's wherever the
    base's is kept, and lora_A's where it is not. With the default targets (all seven layers) a block keeps
    q/v/gate/down's outputs twice, and three rank-wide ones: twice op_level_kept_bytes' matmul outputs. The
    simulated step (tests/test_plan_simulation.py, Llama 3.1 8B, rank 16) found it: without this plan was 17%
    under it."""
    lora = model.lora
    if lora is None:
        return 0
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": model.dim, "gate_proj": model.ffn_dim,
              "up_proj": model.ffn_dim, "down_proj": model.dim}  # fmt: skip
    outputs: list[int] = []
    for name in FORWARD_ORDER:
        path = f"model.layers.0.{'self_attn' if name in ATTENTION else 'mlp'}.{name}"
        outputs += [widths[name], lora.rank, widths[name]] if lora_targets(path, lora.targets) else [widths[name]]
    kept = sum(outputs[::2])  # the 1st, 3rd, 5th ... matmul's output
    plain = sum(widths[name] for name in FORWARD_ORDER[::2])  # q, v, gate, down: op_level_kept_bytes' count
    return compute * batch * seq_len * (kept - plain)


# The template's [lora] table (config.toml.jinja): what a key left out of a project's, and plan --lora, take.
LORA_DEFAULTS = {"rank": 16, "dropout": 0.0, "target_modules": list(ATTENTION + MLP)}


def read_lora(path: Path, table: Any, model: HfShape) -> LoraSpec:
    """config.toml's [lora] (the template's defaults for keys left out), checked as config.py and peft check it."""
    defaults = LORA_DEFAULTS
    fix = "fix that value in the file"
    if not isinstance(table, dict):
        raise HfConfigError(f"{path}: [lora] must be a table, got {table!r}; {fix}")
    lora = defaults | {key: table[key] for key in defaults if key in table}
    rank, dropout, targets = lora["rank"], lora["dropout"], lora["target_modules"]
    if type(rank) is not int or not 1 <= rank <= 2**20:
        raise HfConfigError(f"{path}: lora.rank must be an int from 1 to {2**20}, got {rank!r}; {fix}")
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise HfConfigError(f"{path}: lora.dropout must be a number from 0 to below 1, got {dropout!r}; {fix}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise HfConfigError(f"{path}: lora.target_modules must be a non-empty list of layer names; {fix}")
    spec = LoraSpec(rank=rank, targets=tuple(targets), dropout=float(dropout))
    beyond = [
        target for target in targets if not any(lora_targets(f"self_attn.{name}", (target,)) for name in ATTENTION)
    ]
    if model.moe_layers and beyond:
        raise HfConfigError(
            f"{path}: lora.target_modules {beyond}: plan models LoRA on the attention layers of a mixture-of-experts "
            "model only (not peft's adapters on transformers' fused experts, nor its dense MLPs); plan with "
            f"target_modules among {list(ATTENTION)}"
        )
    adapted = [name for name, _ in hf_parameter_shapes(replace(model, lora=spec)) if ".lora_A." in name]
    if not adapted:
        raise HfConfigError(
            f"{path}: lora.target_modules {targets} match no layer plan can adapt; its linear layers are "
            f"{sorted(ATTENTION + MLP)}"
        )
    return spec
