"""The planner's model shapes: the sizes `plan --size` takes, each parameter's shape as a tensor-parallel rank
holds it, and parameter counts. Pure arithmetic on shapes (the generator imports no torch)."""

from __future__ import annotations

import math

from fsdp2gen.plan_families import (
    HfShape,
    hf_parameter_shapes,
)
from fsdp2gen.sizes import (
    LLAMA3_VOCAB,
    LlamaShape,
    sizes,
    template_model_defaults,
    template_sizes,
    template_unset,
)

FP32 = 4

INT64 = 8

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

MIB, GIB = 2**20, 2**30

# The llama sizes `--size` takes (model.size's names, then larger published shapes) and the ModelArgs defaults
# a config.toml's [model] leaves out: read from the template's model.py (see sizes.py). A 0 takes the value of
# model.size (TEMPLATE_SIZES, the template's SIZES), exactly as the project's model.py does.
SIZES = sizes()

TEMPLATE_MODEL = template_model_defaults()

TEMPLATE_SIZES = template_sizes()

TEMPLATE_UNSET = template_unset()

# The Llama 3 shapes among them (its 128256-token vocabulary), untied: 1b and 3b carry one more vocab x dim
# matrix than Meta's checkpoints, which tie the output layer to the embedding (a project's model.tie_embeddings).
LLAMA_SIZES = {name: shape for name, shape in SIZES.items() if shape.vocab_size == LLAMA3_VOCAB}

# The mixture-of-experts sizes (model.size's debug-moe, qwen3-30b-a3b, deepseek-v3).
MOE_SIZES = [name for name, shape in SIZES.items() if shape.n_experts]


def parameter_shapes(model: LlamaShape, tp: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """model.py's parameters in named_parameters() order, each as its tensor-parallel rank holds it.

    With tp > 1, column-parallel weights (wq, wk, wv, w1, w3, embedding and output rows) split dim 0 and
    row-parallel ones (wo, w2) dim 1, as torchtitan does; norms are replicated.
    """
    if isinstance(model, HfShape):
        return hf_parameter_shapes(model, tp)  # split as the model's declared tensor-parallel plan says
    d, hd = model.dim, model.head_dim

    def column(rows: int, cols: int) -> tuple[int, int]:
        return (math.ceil(rows / tp), cols)

    def row(rows: int, cols: int) -> tuple[int, int]:
        return (rows, math.ceil(cols / tp))

    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", column(model.vocab_size, d))]
    for i in range(model.n_layers):
        block = f"layers.{i}."
        shapes += [
            (block + "attention_norm.weight", (d,)),
            (block + "attention.wq.weight", column(model.n_heads * hd, d)),
            (block + "attention.wk.weight", column(model.n_kv_heads * hd, d)),
            (block + "attention.wv.weight", column(model.n_kv_heads * hd, d)),
            (block + "attention.wo.weight", row(d, model.n_heads * hd)),
            (block + "ffn_norm.weight", (d,)),
        ]
        shapes += moe_shapes(model, block) if i in model.moe_layers else [
            (block + "feed_forward.w1.weight", column(model.ffn_dim, d)),
            (block + "feed_forward.w2.weight", row(d, model.ffn_dim)),
            (block + "feed_forward.w3.weight", column(model.ffn_dim, d)),
        ]  # fmt: skip
    shapes += [("norm.weight", (d,))]
    if not model.tie_embeddings:
        shapes += [("output.weight", column(model.vocab_size, d))]
    return shapes


def moe_shapes(model: LlamaShape, block: str) -> list[tuple[str, tuple[int, ...]]]:
    """A mixture-of-experts feed-forward's parameters (moe.py's MoE, named_parameters() order): the router's gate,
    the experts' stacked w1, w2, w3 (n_experts, out, in), and the shared experts' one SwiGLU (if any)."""
    d, e, h = model.dim, model.n_experts, model.moe_ffn_dim
    shapes = [(block + "feed_forward.router.gate.weight", (e, d))]
    shapes += [(block + f"feed_forward.experts.{w}", (e, d, h) if w == "w2" else (e, h, d)) for w in ("w1", "w2", "w3")]
    shared = model.n_shared_experts * h
    if shared:
        shapes += [(block + f"feed_forward.shared_experts.{w}.weight", (d, shared) if w == "w2" else (shared, d))
                   for w in ("w1", "w2", "w3")]  # fmt: skip
    return shapes


def is_expert(name: str) -> bool:
    """Whether parameter `name` is a routed expert's stacked weight (sharded over ep, then dp_shard / ep): llama's
    experts.w1/w2/w3, transformers' fused experts.gate_up_proj and experts.down_proj (hf: no ep, dp_shard)."""
    return ".experts.w" in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


def has_experts(model: LlamaShape) -> bool:
    """Whether `model` is a mixture-of-experts model (a llama with model.n_experts, an hf MoE config.json)."""
    return model.n_experts > 0 and len(model.moe_layers) > 0


def parameter_count(model: LlamaShape) -> int:
    return sum(math.prod(shape) for _, shape in parameter_shapes(model))


def active_parameter_count(model: LlamaShape) -> int:
    """The parameters one token goes through: all but the routed experts it is not sent to (each MoE layer's
    n_experts - top_k of them); the router, the shared experts, the embedding and the output layer count."""
    if not has_experts(model):
        return parameter_count(model)
    # Three dim x moe_ffn_dim matrices per expert: w1, w2, w3 (llama), gate, up, down (transformers' fused ones).
    idle = (model.n_experts - model.top_k) * 3 * model.dim * model.moe_ffn_dim
    return parameter_count(model) - len(model.moe_layers) * idle


def shard_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of the largest dim-0 shard (rank 0's); FSDP2 pads every rank's shard to this size."""
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def expert_shard_numel(shape: tuple[int, ...], dp_shard: int, ep: int) -> int:
    """Elements of rank 0's shard of a stacked expert weight (n_experts, a, b). ep 1: part of its block, on dim 0
    over dp_shard like any weight (padded to whole experts when they are fewer than the ranks). ep > 1
    (expert_parallel.py, as torchtitan): whole experts over the ep ranks, then fully_shard over the dp_shard / ep
    ranks that hold the same ones, on dim 0 while each rank's experts are at least as many as those ranks, else on
    dim 1 (shard_placement_fn), padded as FSDP2 pads."""
    if ep == 1:
        return shard_numel(shape, dp_shard)
    local, ranks = math.ceil(shape[0] / ep), dp_shard // ep
    if local >= ranks:
        return math.ceil(local / ranks) * math.prod(shape[1:])
    return local * math.ceil(shape[1] / ranks) * shape[2]


# The input embedding's weight: llama's name, and hf's.
EMBEDDINGS = ("tok_embeddings.weight", "model.embed_tokens.weight")


def in_block(name: str, index: str = "") -> bool:
    """Whether parameter `name` is in a block (`index` "0.": the first one): llama's layers.N., hf's model.layers.N."""
    return name.startswith(("layers." + index, "model.layers." + index))
