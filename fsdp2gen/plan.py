"""`fsdp2gen plan`: per-GPU memory of FSDP2 training of the generated Llama model, before launching it.

The estimate follows what a generated project's train.py and model.py actually do:

- fully_shard keeps each rank's parameter shards in fp32 (the model is built in fp32); with bf16/fp16
  the MixedPrecisionPolicy casts them for compute only, so the shards *are* the master weights
  (no extra copy). Shards are dim-0 chunks padded to ceil(rows / ranks), like FSDP2 allocates them.
- Gradients are reduce-scattered in fp32 (reduce_dtype=float32), so the gradient shards are fp32.
- With grad_accum_steps > 1 and training.grad_sync = "last_micro_batch" (set_requires_gradient_sync(False)
  on all but the last micro-batch), FSDP2 keeps each parameter's unsharded gradient, upcast to reduce_dtype
  (fp32), from the first micro-batch until the last one's backward: every rank holds the whole model's
  gradients (its tensor-parallel slice) instead of its shard. "every_micro_batch" (the default) reduce-scatters
  after each micro-batch into the sharded gradients: no extra memory, grad_accum_steps x the reduce-scatters.
- AdamW keeps exp_avg and exp_avg_sq (fp32, shaped like the shards) and one 4-byte step per tensor.
- Each transformer block is one FSDP unit, the root (embeddings, final norm, output) another. The root
  stays gathered from forward until the end of backward; blocks are gathered one at a time with the
  next one prefetched.
- Activations are the tensors autograd saves for backward in model.py's forward and the fp32 loss,
  counted op by op (see `block_activation_bytes`). The attention is scaled_dot_product_attention with a
  flash/memory-efficient kernel: no seq x seq matrix is kept.
- The step's peak is the highest of three moments: the blocks' backward (gathered root and blocks, reduce-scatter
  buffers, all activations); the loss's backward, which comes first (`loss_backward_bytes`): the cross-entropy's
  backward makes two (loss_parallel: three) fp32 tensors of the logits' size (of one chunk's with training.loss_chunks
  > 1, beside the output layer's gradient); and the end of backward, where every gradient shard exists beside the
  root's unsharded gradients and their reduce_dtype copy. The last two were missing, and the root's unsharded
  gradients counted the embedding's during the blocks' backward (it comes last): plan was 13-21% under torch's
  FSDPMemTracker (1B without TP, the 8B headline run at batch 2 x 8192, 70B with TP 8) and 16% over with CPU offload,
  against the simulated step (a project's scripts/plan_memory.py) in tests/test_plan_simulation.py; every row is now
  within 10% (the largest gap, -9% for 70B with TP 8: DTensor copies at the end of backward not modelled).
- `reserved` is what the CUDA caching allocator holds at that peak (RESERVED_RATIO, measured the same way).

The generator must not import torch, so everything here is arithmetic on shapes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import tomllib
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from fsdp2gen.files import FileInputError, read_text
from fsdp2gen.plan_families import (
    HfConfigError,
    HfShape,
    hf_block_activation_bytes,
    hf_parameter_shapes,
    is_trainable,
    lora_activation_delta,
    lora_op_level_delta,
    read_hf_config,
    read_lora,
)
from fsdp2gen.questions import questions, read_answers, template_dir
from fsdp2gen.sizes import (
    LLAMA3_VOCAB,
    LlamaShape,
    shape_of,
    sizes,
    template_model_defaults,
    template_sizes,
    template_unset,
)

FP32 = 4
INT64 = 8
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# activation_checkpointing's choices (copier.yml), from the least recomputation to the most.
AC_MODES = ("none", "selective", "layer", "full")
# training.grad_sync of the generated config: when gradients are reduce-scattered under accumulation.
GRAD_SYNC_MODES = ("every_micro_batch", "last_micro_batch")
MIB, GIB = 2**20, 2**30
# Left for the CUDA context, NCCL's own buffers and allocator fragmentation.
USABLE_FRACTION = 0.9
# What the CUDA caching allocator reserves (nvidia-smi's figure, what an OOM reports) over what is allocated, at the
# step's peak: it rounds each block up (to 512 bytes, or 2 MiB above 1 MiB). Measured by the project's
# scripts/plan_memory.py (the live tensors at FSDPMemTracker's peak, each rounded): at most 1.005x over
# tests/test_plan_simulation.py's matrix; fragmentation over many steps comes on top (USABLE_FRACTION's margin).
RESERVED_RATIO = 1.01


class PlanError(ValueError):
    """Input the user can fix; the CLI reports it as one line with exit code 2."""


# Upper bounds of the inputs: GPUs per node and nodes as the generator's copier.yml bounds them; the rest far
# above any model or run there is, so that a typo (an extra digit or ten) is refused instead of planned, and
# the per-layer arithmetic stays instant. Every input is at least 1.
LIMITS = {"--gpus": 64, "--nodes": 16384, "--tp": 64, "--cp": 64, "--ep": 2**16, "--batch": 2**16, "--seq": 2**24}
LIMITS |= {"--pp": 2**12, "--pp-stages-per-rank": 2**12, "--grad-accum-steps": 2**16}
MODEL_LIMITS = {
    "dim": 2**17,
    "n_layers": 2**12,
    "n_heads": 2**12,
    "n_kv_heads": 2**12,
    "vocab_size": 2**22,
    "ffn_dim": 2**20,
    "max_seq_len": 2**24,
}
TRAINING_LIMITS = {"global_batch_size": 2**24, "seq_len": 2**24, "grad_accum_steps": 2**16}


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
TEMPLATE_TRAINING = {"global_batch_size": 32, "seq_len": 256, "grad_accum_steps": 1}
TEMPLATE_GRAD_SYNC = "every_micro_batch"
# training.loss_chunks of the generated config: the loss's logits are computed this many sequence chunks at a time.
TEMPLATE_LOSS_CHUNKS = 8


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # total memory as nvidia-smi reports it


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("h100-80gb", 81559 * MIB),
        Gpu("h200-141gb", 143771 * MIB),
        Gpu("a100-80gb", 81920 * MIB),
        Gpu("a100-40gb", 40960 * MIB),
        Gpu("l40s-48gb", 46068 * MIB),
        Gpu("a10-24gb", 23028 * MIB),
        Gpu("rtx4090-24gb", 24564 * MIB),
        Gpu("v100-32gb", 32768 * MIB),
        Gpu("v100-16gb", 16384 * MIB),
    )
}


# The generated project's layout.py: the one place that lays ranks out on the mesh. Loaded by path (it imports no
# torch at import time), so that plan splits the model and the batch exactly as the project's train.py does.
LAYOUT_FILE = Path("project") / "layout.py"


@cache
def layout_module() -> ModuleType:
    """The template's layout.py as a module (ParallelLayout, LayoutError)."""
    spec = importlib.util.spec_from_file_location("fsdp2gen_project_layout", template_dir() / LAYOUT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while they build the class
    spec.loader.exec_module(module)
    return module


def parallel_layout(world_size: int, tp: int, cp: int = 1, pp: int = 1) -> Any:
    """The ParallelLayout of a project with parallel.tp = `tp` (and parallel.cp = `cp`, parallel.pp = `pp`) on
    `world_size` ranks, FSDP over the rest. A project without context (pipeline) parallelism has no parallel.cp
    (parallel.pp): only cp > 1 (pp > 1) names it."""
    extra = ({"cp": cp} if cp > 1 else {}) | ({"pp": pp} if pp > 1 else {})
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, tp=tp, **extra)
    return layout_module().ParallelLayout.of(parallel, world_size)


@dataclass(frozen=True)
class PlanRequest:
    model: LlamaShape
    label: str  # "llama 8b" or the config file
    gpus: int = 8
    nodes: int = 1
    precision: str = "bf16"
    offload: bool = False
    ac: str = "none"
    tp: int = 1
    cp: int = 1  # context parallelism: each rank of a cp group holds seq_len / cp tokens of every sample
    ep: int = 1  # expert parallelism: each rank holds n_experts / ep experts, ranks borrowed from dp_shard
    seq_len: int = 8192
    micro_batch: int | None = None  # samples per GPU per forward; None: from global_batch_size
    global_batch_size: int | None = None
    grad_accum_steps: int | None = 1  # None: not known (--size), assumed > 1 for grad_sync
    grad_sync: str = TEMPLATE_GRAD_SYNC
    gpu: str = "h100-80gb"
    task: str = "pretrain"  # the project's task: "sft" masks the prompt's targets, the same memory
    loss_chunks: int = TEMPLATE_LOSS_CHUNKS
    # Pipeline parallelism (plan_pp.py): pp ranks of pp x pp_stages_per_rank stages; under pp > 1 grad_accum_steps
    # is the schedule's number of micro-batches. pp_layers: parallel.pp_layers, each stage's blocks (() = even).
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_layers: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def data_ranks(self) -> int:
        """The ranks that read different samples (layout.py's data_ranks: dp_shard, without cp and tp)."""
        return parallel_layout(self.world_size, self.tp, self.cp, self.pp).data_ranks

    @property
    def fsdp_ranks(self) -> int:
        """The ranks a parameter is sharded over: dp_shard x cp (FSDP over the flattened mesh, as torchtitan), so
        for a fixed number of GPUs and tp the state per GPU does not change with cp."""
        return self.data_ranks * self.cp

    @property
    def local_seq_len(self) -> int:
        """The tokens of each sample one rank holds: seq_len / cp (2 x cp load-balanced chunks, 2 per rank)."""
        return self.seq_len // self.cp

    @property
    def batch(self) -> int:
        if self.micro_batch is not None:
            return self.micro_batch
        if self.global_batch_size is not None:
            return self.global_batch_size // (self.data_ranks * (self.grad_accum_steps or 1))
        return 1

    @property
    def defers_gradients(self) -> bool:
        """Every rank holds unsharded gradients across micro-batches: last_micro_batch while accumulating."""
        accumulating = self.grad_accum_steps is None or self.grad_accum_steps > 1
        return self.grad_sync == "last_micro_batch" and accumulating


def parameter_shapes(model: LlamaShape, tp: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """model.py's parameters in named_parameters() order, each as its tensor-parallel rank holds it.

    With tp > 1, column-parallel weights (wq, wk, wv, w1, w3, embedding and output rows) split dim 0 and
    row-parallel ones (wo, w2) dim 1, as torchtitan does; norms are replicated.
    """
    if isinstance(model, HfShape):
        return hf_parameter_shapes(model)  # the hf family has no tensor parallelism
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
    """Whether parameter `name` is a routed expert's stacked weight (sharded over ep, then dp_shard / ep)."""
    return ".experts.w" in name


def parameter_count(model: LlamaShape) -> int:
    return sum(math.prod(shape) for _, shape in parameter_shapes(model))


def active_parameter_count(model: LlamaShape) -> int:
    """The parameters one token goes through: all but the routed experts it is not sent to (each MoE layer's
    n_experts - top_k of them); the router, the shared experts, the embedding and the output layer count."""
    if isinstance(model, HfShape) or not model.n_experts:
        return parameter_count(model)
    idle = (model.n_experts - model.top_k) * 3 * model.dim * model.moe_ffn_dim
    return parameter_count(model) - len(model.moe_layers) * idle


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


def request_shard_numel(request: PlanRequest, name: str, shape: tuple[int, ...]) -> int:
    """Elements of rank 0's shard of parameter `name` under the request's layout: experts by expert_shard_numel,
    the rest over all FSDP ranks."""
    if is_expert(name):
        return expert_shard_numel(shape, request.fsdp_ranks, request.ep)
    return shard_numel(shape, request.fsdp_ranks)


def gathered_numel(request: PlanRequest, name: str, shape: tuple[int, ...]) -> int:
    """Elements of `name` once FSDP all-gathers it: the whole tensor, or for an expert weight this rank's
    n_experts / ep experts."""
    return math.prod(shape) // request.ep if is_expert(name) else math.prod(shape)


def shard_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of the largest dim-0 shard (rank 0's); FSDP2 pads every rank's shard to this size."""
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def norm_activation_bytes(hidden: int, compute: int) -> int:
    """RMSNorm's saved tensors for `hidden` elements, in model.py's fp32-normalising forward.

    fp32: the input (pow, mul) and the normalised x (weight mul). bf16/fp16: two fp32 copies of the input
    (x.float() is called twice) and the normalised x cast back to the compute dtype.
    """
    return 2 * FP32 * hidden if compute == FP32 else (2 * FP32 + compute) * hidden


def moe_activation_parts(model: LlamaShape, tokens: int, compute: int, ep: int = 1) -> dict[str, int]:
    """What one mixture-of-experts feed-forward (moe.py's MoE) saves for backward, for `tokens` tokens on one rank,
    by part; all of it is held until the block's backward. (Its input, the normalised tokens, is counted with the
    block: the router's gate and the shared experts read it as a dense block's w1/w3 do.)

    - router: the scores of all experts (softmax or sigmoid output, fp32), the top_k chosen scores and their sum
      (the normalisation's division keeps both) and the normalised weights (the combine's multiply keeps them);
    - indices: the chosen experts (topk's and gather's), the sorted choices' token indices (the dispatch gather)
      and the inverse order (the combine gather), int64, tokens x top_k each; with ep > 1 two more, the orders
      expert_parallel.py puts the received copies in (by expert) and back (by sender);
    - routed copies: tokens x top_k copies of the tokens in expert order, the experts' input (compute dtype);
      under expert parallelism the copies this rank received from the dispatch all-to-all instead, as many when
      the routing is balanced;
    - expert hidden: per routed copy the SwiGLU's w1 output, silu output, w3 output and their product;
    - combine: the experts' outputs back in token order, in fp32 for the weighted sum over the top_k choices;
    - shared experts: a dense SwiGLU of n_shared_experts x moe_ffn_dim hidden units.
    The auxiliary balance loss (model.aux_loss_coef > 0) adds one fp32 per token (the scores' sums): not counted.
    """
    routed = tokens * model.top_k
    return {
        "router": FP32 * tokens * (model.n_experts + 2 * model.top_k + 1),
        "indices": INT64 * (3 if ep == 1 else 5) * routed,
        "routed copies": compute * routed * model.dim,
        "expert hidden": 4 * compute * routed * model.moe_ffn_dim,
        "combine": FP32 * routed * model.dim,
        "shared experts": 4 * compute * tokens * model.n_shared_experts * model.moe_ffn_dim,
    }


def all_to_all_bytes(model: LlamaShape, tokens: int, compute: int, ep: int) -> int:
    """Expert parallelism's dispatch and combine all-to-alls for one MoE layer: each rank sends its tokens x top_k
    routed copies and receives as many (balanced routing), in the compute dtype; the send and receive buffers of
    one exchange coexist, and backward exchanges the gradients the same way. Not held for backward (the received
    copies are: moe_activation_parts' routed copies), so one layer's pair at the peak. 0 without ep."""
    if ep == 1 or isinstance(model, HfShape) or not model.n_experts:
        return 0
    return 2 * compute * tokens * model.top_k * model.dim


def grouped_backward_bytes(model: LlamaShape, tokens: int, compute: int) -> int:
    """The grouped GEMM's backward (moe.py's grouped_swiglu, torch._grouped_mm: what H100-class GPUs run in bf16):
    each weight gradient multiplies the transposed routed copies and output gradients, which the kernel takes
    row-major, so it copies both: tokens x top_k x (dim + moe_ffn_dim) in the compute dtype at w1's/w3's, one
    layer at a time. Measured by the simulation (fake tensors run the kernel's layout rules); 0 for a dense model."""
    if isinstance(model, HfShape) or not model.n_experts:
        return 0
    return compute * tokens * model.top_k * (model.dim + model.moe_ffn_dim)


def block_activation_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, moe: bool = False, ep: int = 1
) -> int:
    """Bytes one TransformerBlock saves for backward, for `batch` x `seq_len` tokens, on one rank (`moe`: a
    mixture-of-experts block, whose feed-forward saves moe_activation_parts; no tensor parallelism there).

    With tp > 1 (train.py's apply_tensor_parallel, torchtitan's layout) a rank holds 1/tp of everything (the
    norms' tokens, the attention heads, the MLP's hidden units) except the inputs of wq/wk/wv and of w1/w3:
    attention and the MLP all-gather the sequence, and their first matmuls keep that full input for backward.
    """
    tokens = batch * seq_len
    hidden = tokens * model.dim
    kv = tokens * model.n_kv_heads * model.head_dim
    ffn = tokens * model.ffn_dim
    split = 2 * norm_activation_bytes(hidden, compute)
    # Rotated q, k, v and the attention output (laid out as batch, seq, heads, so wo's input is a view of it).
    split += compute * (hidden + 2 * kv + hidden)
    # w1 output (silu), silu output and w3 output (their product), and w2's input.
    split += sum(moe_activation_parts(model, tokens, compute, ep).values()) if moe else 4 * compute * ffn
    # rsqrt of both norms and attention's logsumexp, in fp32.
    split += FP32 * (2 * tokens + batch * model.n_heads * seq_len)
    # The input of wq/wk/wv (one tensor) and the input of w1/w3: full sequence on every tp rank.
    whole = compute * 2 * hidden
    if compute != FP32:
        # MixedPrecisionPolicy casts the block's rotary inputs, (cos, cos) and (-sin, sin), to the compute dtype.
        whole += 2 * seq_len * model.head_dim * compute
    return math.ceil(split / tp) + whole


def head_activation_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, loss_chunks: int = 1
) -> int:
    """Final norm, output layer input, the fp32 log-softmax of the loss, and the token ids and targets.

    With tp > 1 the final norm's tokens and the logits' vocabulary are split (loss_parallel); the output
    layer's input (all-gathered) and the token ids are whole on every tp rank. With loss_chunks > 1
    (chunked_loss.py) the log-softmax is that of one chunk of the sequence: forward keeps none, and backward
    recomputes one chunk at a time while every block's activations are still held.
    """
    tokens = batch * seq_len
    hidden = tokens * model.dim
    split = norm_activation_bytes(hidden, compute) + FP32 * tokens
    return (
        math.ceil(split / tp)
        + FP32 * batch * math.ceil(seq_len / loss_chunks) * math.ceil(model.vocab_size / tp)
        + compute * hidden
        + 2 * INT64 * tokens
        + FP32  # cross_entropy's total_weight
    )


def loss_backward_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, loss_chunks: int = 1
) -> int:
    """What the loss's backward adds to the saved activations, at its peak. The loss is computed inside the
    model's forward (chunked_loss.py), so nothing outside it holds the logits; the cross-entropy saved its fp32
    log-softmax (head_activation_bytes). Its backward makes fp32 tensors of the logits' size: two (the gradients
    of the log-softmax's output and of its input) without tensor parallelism, three with loss_parallel (the
    one-hot mask, exp(log-softmax), the scaled gradient). With loss_chunks > 1 those are one chunk's, and the
    output layer's unsharded gradient (compute dtype) is there from the first chunk on, summing the chunks'.
    Measured with scripts/plan_memory.py (FSDPMemTracker); tests/test_plan_simulation.py checks it.
    """
    vocab = math.ceil(model.vocab_size / tp)
    chunk_logits = FP32 * batch * math.ceil(seq_len / loss_chunks) * vocab
    gradients = (3 if tp > 1 else 2) * chunk_logits
    if loss_chunks == 1:
        return gradients
    return gradients + compute * vocab * model.dim


def op_level_kept_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, moe: bool = False
) -> int:
    """Bytes one block keeps under op-level selective AC (activation_checkpoint.py, torchtitan's policy): the
    outputs of its 1st, 3rd, 5th and 7th matmuls (wq, wv, w1, w2; wk, wo and w3 are recomputed), attention's
    output and logsumexp, and with tp > 1 the two reduce-scatters' outputs (wo's and w2's, sequence-split).

    tp > 1: wq/wv/w1 outputs hold this rank's heads or hidden units (1/tp); w2's output is the full-sequence
    partial sum that the reduce-scatter then splits. (tests/test_op_level_ac.py measures this figure.)

    `moe`: a mixture-of-experts block's 5th matmul is the router's gate (its output kept), then every other one of
    the experts' w1, w3, w2 matmuls of the per-expert loop (about half of their outputs) and of the shared
    experts'. On H100-class GPUs in bf16 the experts run as torch._grouped_mm, which the policy does not keep: this
    counts the loop's (an upper bound there; not checked against a measurement).
    """
    if moe:
        tokens = batch * seq_len
        attention = compute * (2 * tokens * model.dim + tokens * model.n_kv_heads * model.head_dim)
        attention += FP32 * batch * model.n_heads * seq_len
        routed = tokens * model.top_k
        shared = model.n_shared_experts * model.moe_ffn_dim
        experts = compute * (routed * (2 * model.moe_ffn_dim + model.dim) + tokens * (2 * shared + model.dim)) // 2
        return attention + compute * tokens * model.n_experts + experts
    tokens = batch * seq_len
    hidden = tokens * model.dim
    kv = tokens * model.n_kv_heads * model.head_dim
    ffn = tokens * model.ffn_dim
    # wq's, wv's and w1's outputs, attention's output and logsumexp.
    split = compute * (hidden + kv + ffn + hidden) + FP32 * batch * model.n_heads * seq_len
    if tp > 1:
        split += 2 * compute * hidden  # the reduce-scatters' outputs
    return math.ceil(split / tp) + compute * hidden  # + w2's matmul output


def activation_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, ac: str, tp: int = 1, loss_chunks: int = 1, ep: int = 1
) -> int:
    """Saved activations per GPU at the end of forward (the peak), for one activation checkpointing mode.

    full: every block keeps only its input, and backward recomputes one block at a time.
    layer: every second block (index 0, 2, ...) is checkpointed whole (torchtitan's selective_ac_option=2).
    selective: op-level, every block keeps its input and its expensive ops' outputs (op_level_kept_bytes), and
    backward recomputes the rest of one block at a time.
    With tp > 1 a block's input is this rank's 1/tp of the sequence (sequence parallelism).
    """
    moe = [isinstance(model, LlamaShape) and i in model.moe_layers for i in range(model.n_layers)]
    blocks = {kind: block_activation_bytes(model, batch, seq_len, compute, tp, kind, ep) for kind in set(moe)}
    block_input = math.ceil(compute * batch * seq_len * model.dim / tp)
    head = head_activation_bytes(model, batch, seq_len, compute, tp, loss_chunks)
    if ac == "selective":
        kept = sum(op_level_kept_bytes(model, batch, seq_len, compute, tp, kind) for kind in moe)
        return model.n_layers * block_input + kept + max(blocks.values()) + head
    # layer: blocks 0, 2, 4, ... are checkpointed; full: all of them. Backward recomputes one at a time.
    checkpointed = {"none": [], "layer": moe[::2], "full": moe}[ac]
    kept = sum(blocks[kind] for kind in moe) - sum(blocks[kind] for kind in checkpointed)
    recompute = max((blocks[kind] for kind in checkpointed), default=0)
    return kept + len(checkpointed) * block_input + recompute + head


def ring_attention_bytes(model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, cp: int = 1) -> int:
    """Working memory of one block's ring attention under context parallelism (0 without: plain SDPA), at its
    largest, in the block's backward while every other block's activations are held. `seq_len` is the whole
    sample's; a rank holds seq_len / cp of its tokens, and this tp rank's heads (K/V: the kv heads, which the flash
    kernel takes as they are under GQA).

    torch 2.13's context_parallel rotates K/V with an all-gather by default (_ContextParallelOptions.rotate_method
    ALL_GATHER; set_rotate_method("alltoall") would hold 2 chunks instead of cp). Its backward
    (_templated_ring_attention_backward) gathers the whole sequence's K/V of the layer once; accumulates the
    gradients of q, k and v in fp32 (convert_to_f32), passing the K/V gradients around the ring with all-to-all (the
    one sent and the one received); the load balancing's partial updates copy the q accumulator and half of the
    logsumexp. Per element of the rank's local q, K/V and logsumexp, the peak is exactly (measured with torch's
    MemTracker on gloo ranks for bf16 and fp32, cp 2 and 4, grouped-query attention: tests/test_plan_cp.py; with
    n_heads == n_kv_heads it peaks at another moment, a few % higher):
    q: 2 fp32 + compute / 2; K/V: 4 compute + 2 fp32; the gathered K/V: cp x compute; logsumexp: fp32 / 2.
    (The flash kernel's own workspace is not counted, as it is not without CP.)
    """
    if cp == 1:
        return 0
    local = batch * (seq_len // cp)
    q = math.ceil(local * model.n_heads * model.head_dim / tp)
    kv = 2 * math.ceil(local * model.n_kv_heads * model.head_dim / tp)  # K and V
    lse = math.ceil(local * model.n_heads / tp)
    return (2 * FP32 * q + compute * q // 2) + (4 * compute + 2 * FP32) * kv + compute * cp * kv + FP32 * lse // 2


@dataclass
class Lever:
    option: str
    saves_bytes: int
    total_bytes: int
    fits: bool


@dataclass
class Plan:
    request: PlanRequest
    parameters: int  # of the whole model
    per_gpu: dict[str, int]
    activations: dict[str, int]  # by AC mode
    reserved: int  # what the caching allocator holds at the peak (per_gpu["total"] allocated, blocks rounded)
    host_per_gpu: int  # with --cpu-offload: the state that lives in CPU memory
    # checkpoint = "full": rank 0 gathers the whole model and AdamW state in its CPU memory to write them
    full_checkpoint_host: int
    usable_bytes: int
    fits: bool
    levers: list[Lever]
    trainable: int = 0  # parameters with gradients and optimizer state: all, or with LoRA the adapters
    active_parameters: int = 0  # that one token goes through: parameters less the experts it is not routed to
    # pp > 1: the schedule, its bubble and every pipeline rank's total; per_gpu is the worst rank's (plan_pp.py).
    pipeline: dict[str, Any] | None = None


def estimate(request: PlanRequest, with_levers: bool = True) -> Plan:
    if request.pp > 1:
        return _estimate_pp(request, with_levers)
    model = request.model
    compute = COMPUTE_BYTES[request.precision]
    shapes = parameter_shapes(model, request.tp)
    sharded = sum(request_shard_numel(request, name, shape) for name, shape in shapes)
    # With LoRA only the adapters have gradients and AdamW state (the frozen weights are sharded all the same).
    trainable = [(name, shape) for name, shape in shapes if is_trainable(model, name)]
    trained = sum(request_shard_numel(request, name, shape) for name, shape in trainable)
    # Of the whole model (shapes are this tensor-parallel rank's).
    trained_total = sum(math.prod(shape) for name, shape in parameter_shapes(model) if is_trainable(model, name))
    state = {
        "parameters": FP32 * sharded,
        "gradients": FP32 * trained,
        "optimizer_state": 2 * FP32 * trained + FP32 * len(trainable),
    }
    # Under context parallelism every sequence-linear part (activations, the loss's tokens) is a rank's
    # seq_len / cp tokens (local_seq_len); only the ring attention's gathered K/V spans the whole sequence.
    seq, tp = request.local_seq_len, request.tp
    activations = _activations_by_mode(request, compute)
    per_gpu = {name: 0 if request.offload else size for name, size in state.items()}
    per_gpu |= family_buffers(request, shapes, compute, trainable) | {"activations": activations[request.ac]}
    # last_micro_batch: the whole model's gradients (this rank's TP slice), unsharded in reduce_dtype (fp32),
    # on the GPU even with offload, from the first micro-batch's backward until the last one's. The shards
    # appear as the unsharded gradients are reduce-scattered and freed, so the peak adds the difference.
    unsharded = FP32 * sum(gathered_numel(request, name, shape) for name, shape in trainable)  # experts: n / ep
    per_gpu["deferred_gradients"] = unsharded - per_gpu["gradients"] if request.defers_gradients else 0
    per_gpu |= _exchange_buffers(request, compute)
    per_gpu["loss_backward"] = loss_backward_bytes(model, request.batch, seq, compute, tp, request.loss_chunks)
    per_gpu["total"] = _peak(request, per_gpu, shapes, compute)
    usable = int(GPUS[request.gpu].memory_bytes * USABLE_FRACTION)
    plan = Plan(
        request=request,
        parameters=parameter_count(model),
        active_parameters=active_parameter_count(model),
        trainable=trained_total,
        per_gpu=per_gpu,
        activations=activations,
        reserved=math.ceil(per_gpu["total"] * RESERVED_RATIO),
        host_per_gpu=sum(state.values()) if request.offload else 0,
        # fp32 weights and AdamW's two fp32 moments of every trainable parameter (plus one step count per tensor).
        full_checkpoint_host=FP32 * parameter_count(model) + 2 * FP32 * trained_total + FP32 * len(trainable),
        usable_bytes=usable,
        fits=per_gpu["total"] <= usable,
        levers=[],
    )
    if with_levers and not plan.fits:
        plan.levers = _levers(plan)
    return plan


def _exchange_buffers(request: PlanRequest, compute: int) -> dict[str, int]:
    """Context parallelism's gathered K/V, expert parallelism's all-to-all, the grouped GEMM's backward copies."""
    model, tokens = request.model, request.batch * request.local_seq_len
    return {
        "ring_attention": ring_attention_bytes(model, request.batch, request.seq_len, compute, request.tp, request.cp),
        "all_to_all_buffers": all_to_all_bytes(model, tokens, compute, request.ep),
        "experts_backward": grouped_backward_bytes(model, tokens, compute),
    }


def _estimate_pp(request: PlanRequest, with_levers: bool) -> Plan:
    """The plan of a pipeline-parallel request: the worst pipeline rank's figures (plan_pp.py's model)."""
    from fsdp2gen import plan_pp

    ranks = plan_pp.rank_stages(request)
    worst = plan_pp.worst(ranks)
    model, per_gpu = request.model, worst.per_gpu
    trainable = parameter_count(model)
    usable = int(GPUS[request.gpu].memory_bytes * USABLE_FRACTION)
    m, v = request.grad_accum_steps, request.pp_stages_per_rank
    bubble = plan_pp.bubble_fraction(request.pp, m, request.pp_schedule, v)
    plan = Plan(
        request=request,
        parameters=parameter_count(model),
        active_parameters=active_parameter_count(model),
        trainable=trainable,
        per_gpu=per_gpu,
        activations=worst.activations,
        reserved=math.ceil(per_gpu["total"] * RESERVED_RATIO),
        host_per_gpu=worst.host,
        full_checkpoint_host=3 * FP32 * trainable + FP32 * len(parameter_shapes(model)),
        usable_bytes=usable,
        fits=per_gpu["total"] <= usable,
        levers=[],
        pipeline={
            "schedule": request.pp_schedule,
            "stages_per_rank": request.pp_stages_per_rank,
            "micro_batches": request.grad_accum_steps,
            "bubble_fraction": bubble,
            "worst_rank": worst.rank,
            "worst": plan_pp.describe(request, worst),
            "ranks": [
                {
                    "rank": r.rank,
                    "stages": list(r.stages),
                    "blocks": [[b.start, b.stop] for b in r.blocks],
                    "in_flight": r.in_flight,
                    "total_bytes": r.per_gpu["total"],
                }
                for r in ranks
            ],
        },
    )
    if with_levers and not plan.fits:
        plan.levers = _levers(plan)
    return plan


def _activations_by_mode(request: PlanRequest, compute: int) -> dict[str, int]:
    """Each AC mode's activations per GPU (the plan shows them all, whichever is used), of a rank's local_seq_len
    tokens."""
    model, seq = request.model, request.local_seq_len
    return {
        mode: activation_bytes(model, request.batch, seq, compute, mode, request.tp, request.loss_chunks, request.ep)
        + family_activation_bytes(model, request.batch, seq, compute, mode)
        for mode in AC_MODES
    }


def _peak(
    request: PlanRequest, per_gpu: dict[str, int], shapes: list[tuple[str, tuple[int, ...]]], compute: int
) -> int:
    """The step's peak per GPU: the highest of the three moments of the module docstring."""
    # The blocks' backward (the gathered root and blocks and the reduce-scatter buffers, all the activations
    # counted) and the loss's backward, before any block's (only the root is gathered, no reduce-scatter yet, but
    # the logits-sized tensors of loss_backward).
    in_blocks = sum(size for key, size in per_gpu.items() if key != "loss_backward")
    root_unit = sum(math.prod(shape) for name, shape in shapes if not _in_block(name))  # llama's or hf's names
    at_step = sum(per_gpu[key] for key in ("parameters", "gradients", "optimizer_state", "model_buffers"))
    in_loss = at_step + per_gpu["deferred_gradients"] + compute * root_unit + per_gpu["activations"]
    in_loss += per_gpu["loss_backward"]
    # The end of backward: every gradient shard but the root's, and the root's unsharded gradients
    # (compute dtype) with their reduce_dtype copy, the reduce-scatter's input.
    at_root_reduce = at_step + per_gpu["deferred_gradients"] + (compute + FP32) * root_unit
    total = max(in_blocks, in_loss, at_root_reduce)
    if request.grad_accum_steps == 1:
        # One micro-batch: train_step starts with no gradients (zero_grad(set_to_none=True)), and a block's
        # gradient shards appear only as backward frees its activations, so they are not part of the
        # forward/backward peak; they are at the optimizer step, with the parameters and AdamW state.
        grads = per_gpu["gradients"]
        total = max(in_blocks - grads, in_loss - grads, at_step, at_root_reduce)
    return total


# The input embedding's weight: llama's name, and hf's.
EMBEDDINGS = ("tok_embeddings.weight", "model.embed_tokens.weight")


def _buffers(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]], compute: int) -> dict[str, int]:
    """The model's buffers and FSDP2's all-gather and reduce-scatter buffers, per GPU."""
    model = request.model
    block_unit = largest_block(request, shapes)
    root_unit = sum(math.prod(shape) for name, shape in shapes if not _in_block(name))
    # Under last_micro_batch in fp32 the unsharded gradients of the root and of the block being reduced are
    # the accumulated ones (deferred_gradients), not more memory.
    # The root's unsharded gradients during the blocks' backward: the output layer's and the final norm's (computed
    # first, reduce-scattered with the root's at the end of backward); an untied embedding's come only then.
    # (llama's tok_embeddings, hf's model.embed_tokens; none in LoRA's trainable subset, which has no root weight.)
    embedding = sum(math.prod(shape) for name, shape in shapes if name in EMBEDDINGS) if not model.tie_embeddings else 0
    root_grads = root_unit - embedding
    unsharded_grads = 0 if request.defers_gradients and compute == FP32 else compute * (root_grads + block_unit)
    return {
        # rope_cos and rope_sin: fp32 buffers, not sharded; each MoE block's routing biases, token counts and
        # balance-loss sum (fp32, moe.py).
        "model_buffers": 2 * FP32 * model.max_seq_len * (model.head_dim // 2)
        + FP32 * len(model.moe_layers) * (2 * model.n_experts + 1),
        # The root stays gathered through forward and backward; a block and the prefetched next one.
        "all_gather_buffers": compute * (root_unit + 2 * block_unit),
        # The output layer's unsharded gradients live until the end of backward; a block's unsharded gradients
        # are copied into an fp32 reduce-scatter input.
        "reduce_scatter_buffers": unsharded_grads + FP32 * block_unit,
    }


def largest_block(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """Elements of the largest block once gathered (a mixture-of-experts block's experts: this rank's n_experts /
    ep; a dense model's blocks are all alike)."""
    blocks: dict[str, int] = {}
    for name, shape in shapes:
        if _in_block(name):
            index = name.removeprefix("model.").split(".")[1]
            blocks[index] = blocks.get(index, 0) + gathered_numel(request, name, shape)
    return max(blocks.values(), default=0)


def _in_block(name: str, index: str = "") -> bool:
    """Whether parameter `name` is in a block (`index` "0.": the first one): llama's layers.N., hf's model.layers.N."""
    return name.startswith(("layers." + index, "model.layers." + index))


def family_buffers(
    request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]], compute: int, trainable: list
) -> dict[str, int]:
    """_buffers for any family: FSDP2 gathers every parameter but reduce-scatters only the gradients of the
    `trainable` ones (LoRA: the adapters); hf models keep only rotary's inverse frequencies as buffers (fp32,
    head_dim / 2, and transformers' copy of them) and compute cos and sin in each forward."""
    buffers = _buffers(request, shapes, compute)
    if trainable != shapes:
        buffers["reduce_scatter_buffers"] = _buffers(request, trainable, compute)["reduce_scatter_buffers"]
    if isinstance(request.model, HfShape):
        buffers["model_buffers"] = 2 * FP32 * (request.model.head_dim // 2)
    return buffers


def family_activation_bytes(model: LlamaShape, batch: int, seq_len: int, compute: int, ac: str) -> int:
    """How an hf model's activations differ from activation_bytes' llama count: rotary's cos and sin, computed
    once per forward (batch x seq x head_dim each, compute dtype) and used by every block; the final norm's one
    fp32 copy (model.py keeps two); and in each block that keeps its activations, and the one backward
    recomputes, a transformers block's own count (hf_block_activation_bytes) with LoRA's change
    (lora_activation_delta). Selective AC: the recomputed block only; the kept matmul outputs are
    op_level_kept_bytes' llama count."""
    if not isinstance(model, HfShape):
        return 0
    rotary = 2 * compute * batch * seq_len * model.head_dim
    # The final norm: transformers' RMSNorm keeps one fp32 copy of its input where model.py's keeps two.
    hidden = batch * seq_len * model.dim
    final_norm = (FP32 + compute) * hidden - norm_activation_bytes(hidden, compute)
    block = hf_block_activation_bytes(model, batch, seq_len, compute) - block_activation_bytes(
        model, batch, seq_len, compute
    )
    kept = {"none": model.n_layers, "selective": 1, "layer": model.n_layers // 2 + 1, "full": 1}[ac]
    # Selective AC with LoRA: every block keeps more matmul outputs (lora_op_level_delta).
    matmuls = model.n_layers * lora_op_level_delta(model, batch, seq_len, compute) if ac == "selective" else 0
    return rotary + final_norm + matmuls + kept * (block + lora_activation_delta(model, batch, seq_len, compute))


def _levers(plan: Plan) -> list[Lever]:
    """Each single change that lowers the per-GPU total, largest saving first."""
    request = plan.request
    options: list[tuple[str, PlanRequest]] = []
    for mode in ("full", "layer", "selective"):
        if AC_MODES.index(mode) > AC_MODES.index(request.ac):
            options.append((f"--activation-checkpointing {mode}", replace(request, ac=mode)))
    if not request.offload:
        options.append(("--cpu-offload", replace(request, offload=True)))
    every = replace(request, grad_sync="every_micro_batch")
    if request.defers_gradients:
        options.append(("--grad-sync every_micro_batch", every))
    if request.batch > 1:
        # Halving the micro-batch doubles the accumulation: with last_micro_batch that adds the unsharded
        # gradients, so the lever is offered together with every_micro_batch (accumulation saves memory only then).
        smaller = f"--batch {request.batch // 2}"
        accum = 2 * (request.grad_accum_steps or 1)
        if request.micro_batch is None and request.global_batch_size is not None:
            smaller += " (twice the grad_accum_steps)"
        if request.grad_sync != "every_micro_batch":
            smaller += " --grad-sync every_micro_batch"
        options.append((smaller, replace(every, micro_batch=request.batch // 2, grad_accum_steps=accum)))
    if has_experts(request.model):
        options += _ep_levers(plan)
    elif not isinstance(request.model, HfShape):
        options += _cp_levers(plan) if request.pp == 1 else []
        options += _pp_levers(plan)
    more = replace(request, nodes=request.nodes * 2)
    if request.micro_batch is None and request.global_batch_size is not None:
        if request.global_batch_size % (more.data_ranks * (request.grad_accum_steps or 1)):
            more = replace(more, micro_batch=request.batch)  # the global batch cannot be split further
    options.append((f"--nodes {more.nodes} ({more.world_size} GPUs)", more))
    levers = []
    for option, changed in options:
        total = estimate(changed, with_levers=False).per_gpu["total"]
        if total < plan.per_gpu["total"]:
            levers.append(Lever(option, plan.per_gpu["total"] - total, total, total <= plan.usable_bytes))
    return sorted(levers, key=lambda lever: -lever.saves_bytes)


def has_experts(model: LlamaShape) -> bool:
    """Whether `model` is a mixture-of-experts llama (hf models are planned dense)."""
    return not isinstance(model, HfShape) and model.n_experts > 0


def _ep_levers(plan: Plan) -> list[tuple[str, PlanRequest]]:
    """A larger expert-parallel degree for a mixture-of-experts model: the smallest that fits, else the largest the
    GPUs and the experts allow (a power of 2 times the current one dividing both dp_shard and n_experts). The
    state per GPU stays (experts are sharded over ep x dp_shard / ep either way); what shrinks is the gathered
    block, n_experts / ep experts instead of all, and its gradients before the reduce-scatter."""
    request, found = plan.request, []
    ep = request.ep * 2
    while ep_takes(request, ep):
        changed = replace(request, ep=ep)
        found.append((f"--ep {ep} ({request.model.n_experts // ep} experts per GPU)", changed))
        if estimate(changed, with_levers=False).fits:
            break
        ep *= 2
    return found[-1:]


def _pp_levers(plan: Plan) -> list[tuple[str, PlanRequest]]:
    """A larger pipeline-parallel degree (1F1B, or the request's schedule) for a llama that does not fit: the
    smallest power of 2 times the current pp that fits, else the largest the GPUs (pp x tp dividing them) and the
    blocks allow. Each forward keeps the request's micro-batch; the micro-batches grow to pp where 1F1B needs
    them. Refused setups (cp, tied embeddings) get none."""
    request, found = plan.request, []
    if request.cp > 1 or request.model.tie_embeddings:
        return []
    pp = request.pp * 2
    while request.world_size % (pp * request.tp) == 0 and request.model.n_layers >= pp * request.pp_stages_per_rank:
        m = max(request.grad_accum_steps or 1, pp * request.pp_stages_per_rank)
        changed = replace(request, pp=pp, micro_batch=request.batch, grad_accum_steps=m, pp_layers=())
        label = f"--pp {pp}" + (f" --grad-accum-steps {m}" if m != request.grad_accum_steps else "")
        label += f" ({request.pp_schedule}, FSDP over {changed.fsdp_ranks} rank(s) per stage)"
        found.append((label, changed))
        if estimate(changed, with_levers=False).fits:
            break
        pp *= 2
    return found[-1:]


def _cp_levers(plan: Plan) -> list[tuple[str, PlanRequest]]:
    """A larger context-parallel degree for a long sequence: the smallest that fits, else the largest the GPUs and
    the sequence allow (a power of 2 times the current one, dividing the GPUs per tp group, that cp_takes takes).
    Fewer data ranks read more samples each: under a config's global batch, grad_accum_steps grows by as much, so
    that each forward keeps the same micro-batch."""
    request, found = plan.request, []
    cp = request.cp * 2
    while request.world_size % (cp * request.tp) == 0 and cp_takes(
        request.seq_len, cp, request.tp, request.loss_chunks
    ):
        factor = cp // request.cp
        changed = replace(request, cp=cp)
        label = f"--cp {cp}"
        if request.micro_batch is None and request.global_batch_size is not None:
            changed = replace(changed, grad_accum_steps=request.grad_accum_steps * factor)
            label += f" ({factor}x the grad_accum_steps)"
        found.append((label, changed))
        if estimate(changed, with_levers=False).fits:
            break
        cp *= 2
    return found[-1:]


# The end of a message about a value in a project's config.toml.
FIX_CONFIG = "fix that value in the file"


def _positive(name: str, value: int | None, limit: int) -> None:
    if value is not None and value < 1:
        raise PlanError(f"{name} must be at least 1, got {value}; give {name} 1 or more")
    if value is not None and value > limit:
        raise PlanError(f"{name} must be at most {limit}, got {value}; give {name} {limit} or less")


def _read_config(
    path: Path, model_table: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """([model], [training]) of a generated project's config.toml, and the project's recorded answers
    (`model_table`: read instead of its [model], which an hf project fills with other keys)."""
    raw = _read_toml(path)
    sections = {name: raw.get(name, {}) for name in ("model", "training")}
    if model_table is not None:
        sections["model"] = model_table
    for name, table in sections.items():
        if not isinstance(table, dict):
            raise PlanError(f"{path}: [{name}] must be a table, got {table!r}; {FIX_CONFIG}")
    model = _model_keys(path, sections["model"])
    training = dict(TEMPLATE_TRAINING)
    for key in TEMPLATE_TRAINING:
        value = sections["training"].get(key, training[key])
        if type(value) is not int or not 1 <= value <= TRAINING_LIMITS[key]:
            raise PlanError(
                f"{path}: training.{key} must be an int from 1 to {TRAINING_LIMITS[key]}, got {value!r}; {FIX_CONFIG}"
            )
        training[key] = value
    grad_sync = sections["training"].get("grad_sync", TEMPLATE_GRAD_SYNC)
    if grad_sync not in GRAD_SYNC_MODES:
        raise PlanError(
            f"{path}: training.grad_sync must be one of {', '.join(GRAD_SYNC_MODES)}, got {grad_sync!r}; {FIX_CONFIG}"
        )
    training["grad_sync"] = grad_sync
    loss_chunks = sections["training"].get("loss_chunks", TEMPLATE_LOSS_CHUNKS)
    if type(loss_chunks) is not int or not 1 <= loss_chunks <= training["seq_len"]:
        raise PlanError(
            f"{path}: training.loss_chunks must be an int from 1 to training.seq_len ({training['seq_len']}), got "
            f"{loss_chunks!r}; {FIX_CONFIG}"
        )
    training["loss_chunks"] = loss_chunks
    # GPUs, nodes and precision the project was generated for (flags override them).
    return model, training, _read_answers(path.parent / ".copier-answers.yml")


def _read_toml(path: Path) -> dict[str, Any]:
    """A project's config.toml as a dict."""
    if not path.exists():
        raise PlanError(f"config file {path} not found; pass a generated project's config.toml")
    try:
        return tomllib.loads(read_text(path, "config file", "pass a generated project's config.toml"))
    except FileInputError as error:
        raise PlanError(str(error)) from None
    except tomllib.TOMLDecodeError as error:
        raise PlanError(f"{path}: invalid TOML ({error}); fix the file") from None
    except RecursionError:
        raise PlanError(f"{path}: nested too deeply to read; pass a generated project's config.toml") from None


def _model_keys(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    """config.toml's [model] over ModelArgs' defaults, its zeros taken from model.size, as model.py does."""
    model = dict(TEMPLATE_MODEL)
    for key, value in table.items():
        expected = type(TEMPLATE_MODEL[key]) if key in TEMPLATE_MODEL else None
        if expected is None:
            raise PlanError(f"{path}: unknown key model.{key}; known: {', '.join(TEMPLATE_MODEL)}")
        if type(value) is not expected and not (expected is float and type(value) is int):
            raise PlanError(f"{path}: model.{key} must be {expected.__name__}, got {value!r}; {FIX_CONFIG}")
        if expected is float and not (math.isfinite(value) and value >= 0):
            raise PlanError(f"{path}: model.{key} must be a finite number >= 0, got {value!r}; {FIX_CONFIG}")
        model[key] = value
    if model["size"] not in TEMPLATE_SIZES:
        raise PlanError(
            f"{path}: model.size must be one of {', '.join(TEMPLATE_SIZES)}, got {model['size']!r}; {FIX_CONFIG}"
        )
    # As ModelArgs.__post_init__: a key at its unset value (0, or UNSET's) takes the size's; a size without experts
    # leaves the mixture-of-experts keys of UNSET at 0 (only the shape's are planned).
    for key, value in TEMPLATE_SIZES[model["size"]].items():
        if model[key] == TEMPLATE_UNSET.get(key, 0):
            model[key] = value
    for key in ("n_shared_experts", "n_dense_layers"):
        if model[key] == TEMPLATE_UNSET[key]:
            model[key] = 0
    for key, limit in MODEL_LIMITS.items():
        if not 1 <= model[key] <= limit:
            raise PlanError(f"{path}: model.{key} must be from 1 to {limit}, got {model[key]}; {FIX_CONFIG}")
    return model


def _read_answers(answers_file: Path) -> dict[str, Any]:
    """The project's .copier-answers.yml beside its config.toml ({} when there is none)."""
    if not answers_file.is_file():
        return {}
    try:
        answers = read_answers(answers_file, "fix or delete it")
    except FileInputError as error:
        raise PlanError(str(error)) from None
    for key in ("gpus", "nodes"):
        limit = LIMITS[f"--{key}"]
        if key in answers and (type(answers[key]) is not int or not 1 <= answers[key] <= limit):
            raise PlanError(
                f"{answers_file}: {key} must be an int from 1 to {limit}, got {answers[key]!r}; fix it there or give "
                f"--{key}"
            )
    return answers


def _project_tp(path: Path, answers: dict[str, Any]) -> int:
    """The tensor-parallel degree a project runs with: config.toml's parallel.tp, else the one it was generated
    with (.copier-answers.yml), else 1."""
    return _project_parallel(path, answers, "tp")


def _project_parallel(path: Path, answers: dict[str, Any], name: str) -> int:
    """A degree a project runs with (tp, cp): config.toml's parallel.<name>, else the one it was generated with
    (.copier-answers.yml), else 1."""
    with path.open("rb") as f:
        parallel = tomllib.load(f).get("parallel", {})
    degree = parallel.get(name, answers.get(name, 1)) if isinstance(parallel, dict) else 1
    if type(degree) is not int or degree < 1:
        raise PlanError(f"{path}: parallel.{name} must be a positive int, got {degree!r}; {FIX_CONFIG}")
    return degree


def _project_pipeline(path: Path, answers: dict[str, Any]) -> dict[str, Any]:
    """A project's parallel.pp, pp_schedule, pp_stages_per_rank and pp_layers (absent: no pipeline)."""
    from fsdp2gen.plan_pp import MULTI_STAGE

    parallel = _read_toml(path).get("parallel", {})
    parallel = parallel if isinstance(parallel, dict) else {}
    pp = _project_parallel(path, answers, "pp")
    schedule = parallel.get("pp_schedule", "1F1B")
    v = parallel.get("pp_stages_per_rank", 2 if schedule in MULTI_STAGE else 1)
    layers = parallel.get("pp_layers", [])
    if not isinstance(schedule, str):
        raise PlanError(f"{path}: parallel.pp_schedule must be a string, got {schedule!r}; {FIX_CONFIG}")
    if type(v) is not int or v < 1:
        raise PlanError(f"{path}: parallel.pp_stages_per_rank must be a positive int, got {v!r}; {FIX_CONFIG}")
    if not isinstance(layers, list) or any(type(n) is not int for n in layers):
        raise PlanError(f"{path}: parallel.pp_layers must be a list of ints, got {layers!r}; {FIX_CONFIG}")
    return {"pp": pp, "pp_schedule": schedule, "pp_stages_per_rank": v, "pp_layers": tuple(layers)}


def build_request(
    *,
    size: str | None = None,
    config: Path | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    precision: str | None = None,
    cpu_offload: bool | None = None,
    activation_checkpointing: str | None = None,
    tp: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    gpu_type: str = "h100-80gb",
    grad_sync: str | None = None,
    hf_config: Path | None = None,
    cp: int | None = None,
    ep: int | None = None,
    pp: int | None = None,
    pp_schedule: str | None = None,
    pp_stages_per_rank: int | None = None,
    grad_accum_steps: int | None = None,
) -> PlanRequest:
    """Check the command-line options (raising PlanError) and turn them into a PlanRequest: the model and
    setup of --config's project or of --size, with the options given overriding them."""
    sources = [flag for flag, value in (("--size", size), ("--config", config), ("--hf-config", hf_config)) if value]
    if len(sources) > 1:
        raise PlanError(f"{' and '.join(sources)} both given; the model comes from one of them")
    numbers = {"--gpus": gpus, "--nodes": nodes, "--tp": tp, "--cp": cp, "--ep": ep, "--batch": batch, "--seq": seq}
    numbers |= {"--pp": pp, "--pp-stages-per-rank": pp_stages_per_rank, "--grad-accum-steps": grad_accum_steps}
    ac = activation_checkpointing or "none"
    _check_options(numbers, ac=ac, gpu_type=gpu_type, precision=precision, grad_sync=grad_sync)
    request = _model_request(size=size, config=config, hf_config=hf_config, tp=tp, seq=seq, cp=cp)
    given = {"gpus": gpus, "nodes": nodes, "precision": precision, "tp": tp, "cp": cp, "ep": ep, "micro_batch": batch}
    given |= {"grad_sync": grad_sync, "offload": bool(cpu_offload), "ac": ac, "gpu": gpu_type}
    request = replace(request, **{name: value for name, value in given.items() if value is not None})
    request = _pipeline_request(request, pp, pp_schedule, pp_stages_per_rank, grad_accum_steps)
    _check_request(request, config)
    return request


def _pipeline_request(
    request: PlanRequest, pp: int | None, schedule: str | None, stages_per_rank: int | None, micro_batches: int | None
) -> PlanRequest:
    """The request with the pipeline options given over the project's parallel.pp* keys: a schedule given alone
    takes its own stages per rank (2 for the multi-stage schedules, else 1) unless the project's suit it;
    parallel.pp_layers holds only for the project's own pp and stages per rank; --size's unknown micro-batches are
    pp x V (the fewest every schedule takes)."""
    from fsdp2gen.plan_pp import MULTI_STAGE, PP_SCHEDULES

    if schedule is not None and schedule not in PP_SCHEDULES:
        raise PlanError(f"--pp-schedule {schedule}: choose one of {', '.join(PP_SCHEDULES)}")
    changed = replace(request, pp=pp or request.pp, pp_schedule=schedule or request.pp_schedule)
    interleaved = changed.pp_schedule in MULTI_STAGE
    v = stages_per_rank or request.pp_stages_per_rank
    if stages_per_rank is None and (v >= 2) != interleaved:
        v = 2 if interleaved else 1
    changed = replace(changed, pp_stages_per_rank=v)
    if (changed.pp, v) != (request.pp, request.pp_stages_per_rank):
        changed = replace(changed, pp_layers=())
    if micro_batches is not None:
        changed = replace(changed, grad_accum_steps=micro_batches)
    elif changed.pp > 1 and changed.grad_accum_steps is None:
        changed = replace(changed, grad_accum_steps=changed.pp * v)
    return changed


def _check_options(
    numbers: dict[str, int | None], *, ac: str, gpu_type: str, precision: str | None, grad_sync: str | None
) -> None:
    """The options' own checks, before any file is read: counts in range, names among the choices."""
    for name, value in numbers.items():
        _positive(name, value, LIMITS[name])
    if ac not in AC_MODES:
        raise PlanError(f"--activation-checkpointing {ac}: choose one of {', '.join(AC_MODES)}")
    if gpu_type not in GPUS:
        raise PlanError(f"--gpu-type {gpu_type}: unknown GPU; choose one of {', '.join(GPUS)}")
    if precision is not None and precision not in COMPUTE_BYTES:
        raise PlanError(f"--precision {precision}: choose one of {', '.join(COMPUTE_BYTES)}")
    if grad_sync is not None and grad_sync not in GRAD_SYNC_MODES:
        raise PlanError(f"--grad-sync {grad_sync}: choose one of {', '.join(GRAD_SYNC_MODES)}")


def _model_request(
    *, size: str | None, config: Path | None, hf_config: Path | None, tp: int | None, seq: int | None, cp: int | None
) -> PlanRequest:
    """The request of the one model source given (--config, --size or --hf-config), before the options override it."""
    if config is not None:
        return _project_request(config, tp, seq, cp)
    if size is not None:
        return _size_request(size, seq)
    if hf_config is not None:
        request = _hf_request(hf_config, seq)
        if cp is not None and cp > 1:
            raise PlanError(f"--cp {cp}: context parallelism is built in for family llama only; use --cp 1")
        return request
    raise PlanError(
        f"no model to plan; give --size ({', '.join(SIZES)}), --config PATH/config.toml or --hf-config PATH/config.json"
    )


def _default(name: str, answers: dict[str, Any]) -> Any:
    """The answer the project was generated with, else the template's default (copier.yml)."""
    return answers.get(name, questions()[name].default)


def _project_request(config: Path, tp: int | None, seq: int | None, cp: int | None = None) -> PlanRequest:
    """The model, batch and setup of a generated project's config.toml and recorded answers."""
    family = _read_answers(config.parent / ".copier-answers.yml").get("family", "llama")
    if family == "hf":
        if cp is not None and cp > 1:
            raise PlanError(f"--cp {cp}: context parallelism is built in for family llama only; use --cp 1")
        return _hf_project_request(config, tp, seq)
    if family != "llama":
        raise PlanError(f"family {family}: only llama and hf are planned; plan a llama of similar shape with --size")
    model_keys, training, answers = _read_config(config)
    cp = cp or _project_parallel(config, answers, "cp")
    data = _read_toml(config).get("data", {})
    if cp > 1 and isinstance(data, dict) and data.get("document_mask") is True:
        # As the project's preflight (context_parallel.py) refuses it.
        raise PlanError(
            f"{config}: cp {cp} cannot mask documents (ring attention is causal over the whole sequence); set "
            "data.document_mask = false there, or plan with --cp 1"
        )
    pipeline = _project_pipeline(config, answers)
    return PlanRequest(
        **pipeline,
        model=shape_of(model_keys),
        label=str(config),
        gpus=_default("gpus", answers),
        nodes=_default("nodes", answers),
        precision=str(_default("precision", answers)),
        tp=tp or _project_tp(config, answers),
        cp=cp,
        ep=_project_parallel(config, answers, "ep"),
        seq_len=seq or training["seq_len"],
        global_batch_size=training["global_batch_size"],
        grad_accum_steps=training["grad_accum_steps"],
        grad_sync=training["grad_sync"],
        loss_chunks=training["loss_chunks"],
    )


def _hf_request(path: Path, seq: int | None) -> PlanRequest:
    """A Hugging Face model's config.json (or its folder), with the template's default setup, one sample of --seq
    tokens (default: the template's training.seq_len)."""
    try:
        model = read_hf_config(path)
    except HfConfigError as error:
        raise PlanError(str(error)) from None
    return PlanRequest(
        model=model,
        label=f"{model.model_type} {model.source}",
        **{name: questions()[name].default for name in ("gpus", "nodes", "precision", "tp")},
        seq_len=seq or TEMPLATE_TRAINING["seq_len"],
        grad_accum_steps=None,
        grad_sync=TEMPLATE_GRAD_SYNC,
    )


def _hf_project_request(config: Path, tp: int | None, seq: int | None) -> PlanRequest:
    """A family hf project: the model of its [model] path's config.json (a local folder), its [lora] adapters, its
    [training] batch, and the answers it was generated with."""
    if tp is not None and tp > 1:
        raise PlanError(f"--tp {tp}: tensor parallelism is built in for family llama only; use --tp 1")
    raw = _read_toml(config)
    model_table = raw.get("model", {})
    folder = model_table.get("path") if isinstance(model_table, dict) else None
    if not isinstance(folder, str) or not folder:
        raise PlanError(f"{config}: model.path must name the model's folder (config.json, *.safetensors); {FIX_CONFIG}")
    local = Path(folder).expanduser()
    if not local.is_absolute():
        local = config.parent / local
    if not (local / "config.json").is_file():
        raise PlanError(
            f"{config}: model.path {folder}: no config.json there (plan reads a local folder, relative to the project, "
            "and downloads no hub id); download it (huggingface-cli download) and plan with --hf-config FOLDER"
        )
    try:
        model = read_hf_config(local)
        if "lora" in raw:
            model = replace(model, lora=read_lora(config, raw["lora"], model))
    except HfConfigError as error:
        raise PlanError(str(error)) from None
    # [model] of an hf project has no llama keys: read [training] and the answers with an empty [model].
    _, training, answers = _read_config(config, model_table={})
    lora = f" + LoRA rank {model.lora.rank}" if model.lora else ""
    task = str(_default("task", answers))
    return PlanRequest(
        model=model,
        label=f"{config} ({model.model_type} {model.source}{lora}, task {task})",
        gpus=_default("gpus", answers),
        nodes=_default("nodes", answers),
        precision=str(_default("precision", answers)),
        tp=1,
        seq_len=seq or training["seq_len"],
        global_batch_size=training["global_batch_size"],
        grad_accum_steps=training["grad_accum_steps"],
        grad_sync=training["grad_sync"],
        task=task,
        loss_chunks=training["loss_chunks"],
    )


def _size_request(size: str, seq: int | None) -> PlanRequest:
    """A size's model at its context length (or --seq's) with the template's default setup. The number of
    micro-batches is not known: None (a grad_sync of last_micro_batch then assumes accumulation, the only case
    where it matters)."""
    if size.lower() not in SIZES:
        raise PlanError(f"--size {size}: unknown size; choose one of {', '.join(SIZES)}")
    model = SIZES[size.lower()]
    seq_len = seq or model.max_seq_len
    return PlanRequest(
        model=replace(model, max_seq_len=max(model.max_seq_len, seq_len)),
        label=f"llama {size.lower()}",
        **{name: questions()[name].default for name in ("gpus", "nodes", "precision", "tp")},
        seq_len=seq_len,
        grad_accum_steps=None,
        grad_sync=TEMPLATE_GRAD_SYNC,
    )


def _check_request(request: PlanRequest, config: Path | None) -> None:
    """The checks of model.py's ModelArgs and train.py, on the model and setup to plan."""
    model, tp, seq_len = request.model, request.tp, request.seq_len
    # An hf model's head_dim need not divide its hidden size (config.json's head_dim; read_hf_config checks heads).
    if (model.dim % model.n_heads and not isinstance(model, HfShape)) or model.n_heads % model.n_kv_heads:
        raise PlanError(
            f"{request.label}: dim must be divisible by n_heads, and n_heads by n_kv_heads; change model.dim, "
            "n_heads or n_kv_heads"
        )
    if seq_len > model.max_seq_len and isinstance(model, HfShape):
        raise PlanError(
            f"seq_len {seq_len} exceeds the model's max_position_embeddings {model.max_seq_len} ({model.source}); "
            "lower --seq or training.seq_len"
        )
    if seq_len > model.max_seq_len:
        raise PlanError(
            f"seq_len {seq_len} exceeds model.max_seq_len {model.max_seq_len}; lower --seq or raise model.max_seq_len"
        )
    if request.precision not in COMPUTE_BYTES:
        raise PlanError(f"precision {request.precision} in {config}: choose one of {', '.join(COMPUTE_BYTES)}")
    _check_experts(request)
    _check_pipeline(request)
    # layout.py's checks, as preflight.py runs them, worded with plan's options.
    cp = request.cp
    layout = parallel_layout(request.world_size, tp, cp, request.pp)
    training = SimpleNamespace(
        seq_len=seq_len,
        global_batch_size=request.global_batch_size,
        grad_accum_steps=request.grad_accum_steps,
        loss_chunks=request.loss_chunks,
    )
    try:
        if layout.tp != tp or layout.cp != cp:  # one rank has no mesh (layout.py gives it tp 1, cp 1)
            raise layout_module().LayoutError("", "ranks")
        layout.check_product()
        layout.check_tensor_parallel(training, model)
        if request.micro_batch is None and request.global_batch_size is not None:
            layout.check_batch(training)
        if cp > 1:
            layout.check_context_parallel(training)
    except layout_module().LayoutError as error:
        raise PlanError(_plan_wording(error.problem, request)) from None


def _check_pipeline(request: PlanRequest) -> None:
    """Pipeline parallelism's rules (plan_pp.check_pipeline), and what the project does not build with it."""
    from fsdp2gen import plan_pp

    if request.pp > 1:
        if isinstance(request.model, HfShape):
            raise PlanError(f"--pp {request.pp}: pipeline parallelism is built in for family llama only; use --pp 1")
        for flag, degree in (("--cp", request.cp), ("--ep", request.ep)):
            if degree > 1:
                raise PlanError(f"--pp {request.pp} with {flag} {degree} is not built; use {flag} 1 or --pp 1")
        if has_experts(request.model):
            raise PlanError(
                f"--pp {request.pp}: mixture-of-experts models are not built for pp > 1; use --pp 1 (--ep splits "
                "the experts over GPUs)"
            )
    problem = plan_pp.check_pipeline(request)
    if problem:
        raise PlanError(problem)


def _check_experts(request: PlanRequest) -> None:
    """model_args.py's rules of the mixture-of-experts keys, and expert parallelism's (ep borrows its ranks from
    dp_shard and gives each of them whole experts), worded with plan's options."""
    model, ep = request.model, request.ep
    experts = model.n_experts if isinstance(model, LlamaShape) and not isinstance(model, HfShape) else 0
    if not experts:
        if ep > 1:
            raise PlanError(
                f"--ep {ep}: {request.label} has no experts (model.n_experts 0); use --ep 1 or plan a "
                f"mixture-of-experts size ({', '.join(MOE_SIZES)})"
            )
        return
    if not 1 <= model.top_k <= experts:
        raise PlanError(f"model.top_k ({model.top_k}) must be between 1 and model.n_experts ({experts}); {FIX_CONFIG}")
    if model.moe_ffn_dim < 1 or model.n_dense_layers >= model.n_layers:
        raise PlanError(
            f"model.n_experts {experts} needs model.moe_ffn_dim > 0 and model.n_dense_layers < model.n_layers "
            f"({model.n_layers}); {FIX_CONFIG}"
        )
    for flag, degree in (("--tp", request.tp), ("--cp", request.cp)):
        if degree > 1:
            raise PlanError(
                f"{flag} {degree}: mixture-of-experts models are not built for {flag[2:]} > 1; use {flag} 1 (--ep "
                "splits the experts over GPUs)"
            )
    if ep > 1 and request.world_size == 1:  # layout.py lets one process (a debugging run) hold every expert
        raise PlanError(_plan_wording("ep_ranks", request))
    try:
        expert_layout(request, ep).check_expert_parallel(SimpleNamespace(n_experts=experts))
    except layout_module().LayoutError as error:
        raise PlanError(_plan_wording(error.problem, request)) from None


def expert_layout(request: PlanRequest, ep: int) -> Any:
    """The ParallelLayout whose check_expert_parallel (as a project's preflight runs it) judges `ep` experts
    groups borrowed from request's dp_shard ranks."""
    return layout_module().ParallelLayout(request.world_size, dp_shard=request.fsdp_ranks, ep=ep)


def ep_takes(request: PlanRequest, ep: int) -> bool:
    """Whether a project's layout.py takes parallel.ep = `ep` for request's model and GPUs."""
    try:
        expert_layout(request, ep).check_expert_parallel(request.model)
    except layout_module().LayoutError:
        return False
    return True


def cp_takes(seq_len: int, cp: int, tp: int, loss_chunks: int) -> bool:
    """Whether a project's layout.py (check_context_parallel, as its preflight runs it) takes a sequence of seq_len
    tokens split over cp x tp ranks with training.loss_chunks."""
    if cp == 1:
        return True
    layout = layout_module().ParallelLayout(cp * tp, cp=cp, tp=tp)
    try:
        layout.check_context_parallel(SimpleNamespace(seq_len=seq_len, loss_chunks=loss_chunks))
    except layout_module().LayoutError:
        return False
    return True


def _plan_wording(problem: str, request: PlanRequest) -> str:
    """layout.py's `problem` with plan's options as the fix."""
    model, tp, cp, seq_len, loss_chunks = request.model, request.tp, request.cp, request.seq_len, request.loss_chunks
    ranks = f"--tp {tp} does not divide {request.world_size} GPUs; choose a divisor"
    if cp > 1:  # the degrees that split each sample's tokens (cp, and tp when there is one) must divide the GPUs
        named = f"--cp {cp}" if tp == 1 else f"--cp {cp} x --tp {tp}"
        fix = "a divisor" if tp == 1 else "degrees whose product divides it"
        ranks = f"{named} does not divide {request.world_size} GPUs; choose {fix}"
    return {
        "ranks": ranks,
        # n_heads is a multiple of n_kv_heads (checked above): tp divides both when it divides n_kv_heads.
        "tp_shape": f"--tp {tp} must divide n_kv_heads ({model.n_kv_heads}) and ffn_dim ({model.ffn_dim}); choose a "
        "--tp that divides both",
        # As preflight.py: sequence parallelism gives each tp rank an equal share of every sample's tokens.
        "tp_seq_len": f"--tp {tp} must divide the sequence length ({request.seq_len}); change --seq or --tp",
        # layout.py's check_context_parallel: torch's load balancing cuts each sample into 2 x cp pieces and tp's
        # sequence parallelism splits them again; the chunked loss splits each rank's seq_len / cp tokens.
        "cp_seq_len": f"--cp {cp}: the sequence length ({seq_len}) must be divisible by 2 x cp x tp ({2 * cp * tp}); "
        f"e.g. --seq {_cp_fitting_seq_len(request)}",
        "cp_loss_chunks": f"--cp {cp}: training.loss_chunks ({loss_chunks}) must divide the {seq_len // cp} tokens "
        f"each context-parallel rank holds (seq / cp); e.g. --seq {_cp_fitting_seq_len(request)}",
        "ep_ranks": f"--ep {request.ep} must divide the {request.fsdp_ranks} dp_shard ranks it borrows from "
        f"({request.world_size} GPUs); e.g. --ep {_fitting_ep(request)}",
        "ep_experts": f"--ep {request.ep} must divide model.n_experts ({model.n_experts}): each GPU holds n_experts / "
        f"ep whole experts; e.g. --ep {_fitting_ep(request)}",
        "batch": f"training.global_batch_size ({request.global_batch_size}) is not divisible by "
        f"{request.data_ranks} data-parallel ranks x grad_accum_steps ({request.grad_accum_steps}); change the "
        "config or pass --batch",
    }[problem]


def _fitting_ep(request: PlanRequest) -> int:
    return expert_layout(request, request.ep).fitting_ep(request.model.n_experts)


def _cp_fitting_seq_len(request: PlanRequest) -> int:
    """The sequence length nearest below request's (at least one step) that passes both of cp's checks."""
    step = math.lcm(2 * request.cp * request.tp, request.cp * request.loss_chunks)
    return max(step, request.seq_len // step * step)


def _count(parameters: int) -> str:
    """A parameter count as model cards write it: 8.03B, or 4.24M below a billion."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.2f}M"


def _size(count: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


ROWS = {
    "parameters": "parameters (fp32 shards = master weights)",
    "gradients": "gradients (fp32 shards)",
    "deferred_gradients": "unsharded gradients (whole model fp32 - shards)",
    "optimizer_state": "optimizer state (AdamW: 2 fp32 states)",
    "model_buffers": "model buffers (rotary tables)",
    "all_gather_buffers": "all-gather buffers (root + 2 blocks)",
    "reduce_scatter_buffers": "reduce-scatter buffers (output layer + 1 block)",
    "ring_attention": "ring attention (whole-sequence K/V, fp32 grads)",
    "all_to_all_buffers": "all-to-all buffers (dispatch/combine, 1 layer)",
    "experts_backward": "grouped GEMM backward copies (1 layer)",
    "loss_backward": "loss backward (fp32 logit gradients)",
}


# The rows that mean something else under pp > 1 (plan_pp.py: a rank's stages only, kept gathered).
PP_ROWS = {
    "all_gather_buffers": "gathered stage(s) (no reshard under PP)",
    "deferred_gradients": "unsharded stage gradients (fp32, to last m-b)",
    "reduce_scatter_buffers": "reduce-scatter buffer (1 block, fp32)",
    "gradients": "gradients (fp32 shards) [after backward]",
}


def _sync_line(request: PlanRequest) -> str:
    """Which training.grad_sync the figures assume, and what it costs."""
    steps = "if accumulating" if request.grad_accum_steps is None else f"grad_accum_steps {request.grad_accum_steps}"
    if request.pp > 1:
        return (
            f"gradient sync: pipeline stages keep their blocks gathered and their fp32 gradients unsharded until the "
            f"last of the {request.grad_accum_steps} micro-batches (torch.distributed.pipelining), whatever grad_sync"
        )
    if request.grad_accum_steps == 1:
        return f"gradient sync: {request.grad_sync} (grad_accum_steps 1: one reduce-scatter per step either way)"
    if request.defers_gradients:
        return (
            f"gradient sync: last_micro_batch ({steps}): one reduce-scatter per step, but every GPU holds the "
            "whole model's fp32 gradients until the last micro-batch"
        )
    return f"gradient sync: every_micro_batch ({steps}): gradients stay sharded, one reduce-scatter per micro-batch"


def format_text(plan: Plan) -> str:
    request, model = plan.request, plan.request.model
    lines = [
        f"{request.label}: {_count(plan.parameters)} parameters"
        + (f" ({_count(plan.active_parameters)} active per token)" if has_experts(model) else "")
        + f", {model.n_layers} blocks, dim {model.dim}",
        _setup_line(request),
        _sync_line(request),
        *_pipeline_lines(plan),
        *family_lines(plan),
        "",
        f"{'per GPU':<48}{'memory':>12}",
        *_memory_rows(plan),
        *_activation_rows(plan),
        f"{'total':<48}{_size(plan.per_gpu['total']):>12}",
        f"{'reserved by the CUDA caching allocator':<48}{_size(plan.reserved):>12}",
    ]
    if request.offload:
        lines.append(f"{'CPU memory per GPU (offloaded state)':<48}{_size(plan.host_per_gpu):>12}")
    lines.append(f"{'rank 0 CPU memory to write a full checkpoint':<48}{_size(plan.full_checkpoint_host):>12}")
    lines += _verdict_lines(plan)
    return "\n".join(lines)


def _pipeline_lines(plan: Plan) -> list[str]:
    """pp > 1: the schedule, its bubble, and which pipeline rank the figures below are (the worst)."""
    from fsdp2gen.plan_pp import bubble_formula

    pipeline, request = plan.pipeline, plan.request
    if pipeline is None:
        return []
    v = request.pp_stages_per_rank
    formula = bubble_formula(request.pp_schedule, v)
    return [
        f"pipeline: {request.pp_schedule}, {request.pp} ranks x {v} stage(s) per rank, m = {pipeline['micro_batches']} "
        f"micro-batches (grad_accum_steps) of {request.batch} sample(s); bubble {formula} = "
        f"{pipeline['bubble_fraction']:.1%}",
        "per-GPU rows below: the worst " + pipeline["worst"],
        "  totals by pipeline rank: "
        + ", ".join(f"{r['rank']}: {r['total_bytes'] / GIB:.1f} GiB" for r in pipeline["ranks"]),
    ]


def _setup_line(request: PlanRequest) -> str:
    """The GPUs, how they shard the model (FSDP, cp, TP), the precision and each GPU's tokens."""
    compute = {"fp32": "fp32", "bf16": "bf16 compute", "fp16": "fp16 compute"}[request.precision]
    return (
        f"{request.gpus} GPU(s) x {request.nodes} node(s)"
        + (f", PP {request.pp} (outermost)" if request.pp > 1 else "")
        + f", FSDP over {request.fsdp_ranks} ranks"
        + (" per stage" if request.pp > 1 else "")
        + (f" (dp_shard {request.data_ranks} x cp {request.cp})" if request.cp > 1 else "")
        + (f" x TP {request.tp}" if request.tp > 1 else "")
        + f", {compute}, micro-batch {request.batch} x {request.seq_len} tokens"
        + (f" (seq / cp = {request.local_seq_len} per GPU)" if request.cp > 1 else " per GPU")
        + (", state offloaded to CPU" if request.offload else "")
    )


def _memory_rows(plan: Plan) -> list[str]:
    """A row per ROWS entry that this setup has, marked where it lives on the CPU or peaks after backward."""
    request, rows = plan.request, []
    for key, label in ROWS.items():
        value = plan.per_gpu[key]
        if request.offload and key in ("parameters", "gradients", "optimizer_state"):
            label += " [CPU]"
        if key == "deferred_gradients" and not request.defers_gradients and request.pp == 1:
            continue  # every_micro_batch or no accumulation: the gradients stay sharded
        if key == "ring_attention" and request.cp == 1:
            continue  # no context parallelism: plain SDPA
        if key == "all_to_all_buffers" and request.ep == 1:
            continue  # no expert parallelism: every rank holds every expert
        if key == "experts_backward" and not value:
            continue  # no experts
        if key == "gradients" and request.grad_accum_steps == 1 and not request.offload:
            label += " [after backward]"  # not at the forward/backward peak: see estimate()
        if request.pp > 1 and key == "loss_backward" and not value:
            continue  # not the last stage
        if request.pp > 1 and key in PP_ROWS:
            label = PP_ROWS[key]

        rows.append(f"{label:<48}{_size(value):>12}")
    return rows


def _activation_rows(plan: Plan) -> list[str]:
    """The activations under every AC mode, so the plan compares them; the one planned is marked (used)."""
    labels = (
        ("none", "no AC"),
        ("selective", "selective AC (op-level)"),
        ("layer", "layer AC (every 2nd)"),
        ("full", "full AC"),
    )
    rows = []
    for mode, label in labels:
        used = " (used)" if mode == plan.request.ac else ""
        rows.append(f"{'activations, ' + label + used:<48}{_size(plan.activations[mode]):>12}")
    return rows


def _verdict_lines(plan: Plan) -> list[str]:
    """Whether the total fits the GPU, then the levers that would save the most, largest first."""
    request = plan.request
    gpu = GPUS[request.gpu]
    verdict = "fits" if plan.fits else f"does NOT fit (short by {_size(plan.per_gpu['total'] - plan.usable_bytes)})"
    lines = [f"{request.gpu}: {_size(plan.usable_bytes)} usable of {_size(gpu.memory_bytes)}: {verdict}"]
    if plan.levers:
        best = plan.levers[0]
        outcome = "fits" if best.fits else "still does not fit"
        lines.append(
            f"largest lever: {best.option} saves {_size(best.saves_bytes)} (total {_size(best.total_bytes)}, {outcome})"
        )
        for lever in plan.levers[1:]:
            lines.append(f"  other lever: {lever.option} saves {_size(lever.saves_bytes)}")
    return lines


def family_lines(plan: Plan) -> list[str]:
    """Where an hf model comes from, what LoRA trains, and what task sft changes (nothing in memory)."""
    model, lines = plan.request.model, []
    if isinstance(model, HfShape):
        lines.append(f"model source: {model.source} (Hugging Face {model.model_type})")
        if model.lora is not None:
            lines.append(
                f"LoRA rank {model.lora.rank} on {', '.join(model.lora.targets)}: {plan.trainable:,} trainable "
                "parameters; the frozen weights are sharded and gathered but have no gradients or AdamW state"
            )
    if has_experts(model):
        lines += expert_lines(plan)
    if plan.request.task == "sft":
        lines.append(
            "task sft: the memory of pretraining; the prompt's tokens are masked in the targets (-100, no loss), "
            "which have the same int64 shape"
        )
    return lines


def expert_lines(plan: Plan) -> list[str]:
    """A mixture-of-experts model's layout: its experts, where their weights live per GPU, and what one MoE layer
    holds for backward."""
    request, model = plan.request, plan.request.model
    compute = COMPUTE_BYTES[request.precision]
    experts = [(name, shape) for name, shape in parameter_shapes(model) if is_expert(name)]
    shard = FP32 * sum(request_shard_numel(request, name, shape) for name, shape in experts)
    gathered = compute * sum(gathered_numel(request, name, shape) for name, shape in experts[:3])
    tokens = request.batch * request.local_seq_len
    parts = moe_activation_parts(model, tokens, compute, request.ep)
    held = ", ".join(f"{part} {_size(size)}" for part, size in parts.items() if size)
    lines = [
        f"experts: {model.n_experts} per MoE block x {len(model.moe_layers)} blocks, top {model.top_k}"
        + (f" + {model.n_shared_experts} shared" if model.n_shared_experts else "")
        + f"; ep {request.ep}: {model.n_experts // request.ep} experts per GPU, sharded over dp_shard / ep = "
        f"{request.fsdp_ranks // request.ep} ranks",
        f"expert weights per GPU: {_size(shard)} fp32 shards (of the parameters row), {_size(gathered)} gathered "
        "per MoE block",
        f"MoE block activations held for backward ({tokens} tokens, balanced routing): {held}",
    ]
    if request.ep > 1:
        lines.append(
            f"all-to-all (ep {request.ep}): each GPU sends and receives {tokens} x top_k {model.top_k} token copies "
            f"per exchange (dispatch, combine, and both in backward): {_size(plan.per_gpu['all_to_all_buffers'])} "
            "send + receive buffers, not held for backward"
        )
    return lines


def to_json(plan: Plan) -> dict[str, Any]:
    request = plan.request
    source = request.model.source if isinstance(request.model, HfShape) else f"fsdp2gen llama ({request.label})"
    return {
        "model": {
            "label": request.label,
            "source": source,
            "parameters": plan.parameters,
            "active_parameters": plan.active_parameters,
            "trainable_parameters": plan.trainable,
            "task": request.task,
            **asdict(request.model),
        },
        "setup": {
            "gpus": request.gpus,
            "nodes": request.nodes,
            "world_size": request.world_size,
            "fsdp_ranks": request.fsdp_ranks,
            "tp": request.tp,
            "cp": request.cp,
            "ep": request.ep,
            "precision": request.precision,
            "offload": request.offload,
            "ac": request.ac,
            "micro_batch": request.batch,
            "seq_len": request.seq_len,
            "grad_accum_steps": request.grad_accum_steps,
            "grad_sync": request.grad_sync,
            "loss_chunks": request.loss_chunks,
            **_pipeline_setup(request),
        },
        "pipeline": plan.pipeline,
        "per_gpu_bytes": plan.per_gpu,
        "reserved_bytes_per_gpu": plan.reserved,
        "activations_bytes": plan.activations,
        "host_bytes_per_gpu": plan.host_per_gpu,
        "full_checkpoint_rank0_host_bytes": plan.full_checkpoint_host,
        "gpu": {"name": request.gpu, "memory_bytes": GPUS[request.gpu].memory_bytes, "usable_bytes": plan.usable_bytes},
        "fits": plan.fits,
        "levers": [asdict(lever) for lever in plan.levers],
    }


def _pipeline_setup(request: PlanRequest) -> dict[str, Any]:
    """Pipeline parallelism's keys of the JSON setup, only where there is a pipeline (the plan's "pipeline" is null
    without)."""
    if request.pp == 1:
        return {}
    return {
        "pp": request.pp,
        "pp_schedule": request.pp_schedule,
        "pp_stages_per_rank": request.pp_stages_per_rank,
        "pp_layers": list(request.pp_layers),
    }


def format_json(plan: Plan) -> str:
    return json.dumps(to_json(plan), indent=2)


# `plan --cp-sweep`: the sequence lengths (32k to 256k tokens) and context-parallel degrees it tabulates.
SWEEP_SEQ_LENS = (32768, 65536, 131072, 262144)
SWEEP_CPS = (1, 2, 4, 8)


def cp_sweep(request: PlanRequest) -> list[Plan]:
    """The plan of `request` at every sequence length of SWEEP_SEQ_LENS with every cp of SWEEP_CPS that the GPUs
    allow (cp x tp dividing them) and the project takes (cp_takes), each forward keeping the request's micro-batch
    of whole samples. A model whose max_seq_len is shorter is planned with its rotary tables that long."""
    if isinstance(request.model, HfShape):
        raise PlanError("--cp-sweep: context parallelism is built in for family llama only; plan a llama with --size")
    if has_experts(request.model):
        raise PlanError(
            f"--cp-sweep: mixture-of-experts models are not built for cp > 1; plan {request.label} without --cp-sweep"
        )
    if request.pp > 1:
        raise PlanError(f"--cp-sweep: --pp {request.pp} with cp > 1 is not built; use --pp 1 or drop --cp-sweep")
    plans = []
    for seq_len in SWEEP_SEQ_LENS:
        for cp in SWEEP_CPS:
            if request.world_size % (cp * request.tp) or not cp_takes(seq_len, cp, request.tp, request.loss_chunks):
                continue
            model = replace(request.model, max_seq_len=max(request.model.max_seq_len, seq_len))
            changed = replace(request, model=model, seq_len=seq_len, cp=cp, micro_batch=request.batch)
            plans.append(estimate(changed, with_levers=False))
    return plans


def format_cp_sweep(plans: list[Plan]) -> str:
    """cp_sweep's plans as a table: a row per sequence length, a column per cp, each cell the activations and the
    total per GPU in GiB, marked where it does not fit."""
    request = plans[0].request
    cps = sorted({plan.request.cp for plan in plans})
    cells = {(plan.request.seq_len, plan.request.cp): plan for plan in plans}
    ac = {"none": "no AC", "selective": "selective AC (op-level)", "layer": "layer AC", "full": "full AC"}[request.ac]
    lines = [
        f"{request.label}: {request.gpus} GPU(s) x {request.nodes} node(s)"
        + (f", TP {request.tp}" if request.tp > 1 else "")
        + f", {request.precision}, {ac}, micro-batch {request.batch}, {request.gpu}",
        "per GPU: activations / total in GiB (total: the step's peak, state and ring attention included); "
        f"* does not fit ({_size(plans[0].usable_bytes)} usable)",
        "",
        f"{'seq_len':>8}" + "".join(f"{'cp ' + str(cp):>18}" for cp in cps),
    ]
    for seq_len in sorted({plan.request.seq_len for plan in plans}):
        row = f"{seq_len:>8}"
        for cp in cps:
            plan = cells.get((seq_len, cp))
            if plan is None:
                row += f"{'-':>18}"
                continue
            mark = "" if plan.fits else "*"
            row += f"{plan.activations[request.ac] / GIB:.1f} / {plan.per_gpu['total'] / GIB:.1f}{mark}".rjust(18)
        lines.append(row)
    return "\n".join(lines)


def format_cp_sweep_json(plans: list[Plan]) -> str:
    return json.dumps([to_json(plan) for plan in plans], indent=2)
