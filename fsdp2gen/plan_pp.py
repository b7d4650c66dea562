"""`fsdp2gen plan --pp N`: per-GPU memory of a pipeline-parallel project (llama or hf), for its worst stage.

A project with parallel.pp > 1 splits the blocks into pp x V stages (V = parallel.pp_stages_per_rank virtual stages
per rank, stage i on rank i mod pp): each stage is the model with the other stages' blocks removed, the first
keeping the embedding and the last the final norm, the output layer and the loss. FSDP (and TP) work inside each
stage, over the world / pp / tp ranks of a stage. What differs from a plan without PP (plan.py), per rank:

- State: the fp32 parameter shards, gradient shards and AdamW state of this rank's stages only.
- Gathered parameters: reshard_after_forward is off under PP (torchtitan), and torch.distributed.pipelining's
  stage runs every micro-batch's backward with set_reshard_after_backward(False) and
  set_requires_gradient_sync(False) (stage.py, backward_maybe_with_nosync), resharding and reduce-scattering only
  after the last one (perform_reduce_grad). So every block of the rank's stages stays gathered (compute dtype) from
  the first forward to the end of the step, and its gradients stay unsharded in reduce_dtype (fp32) beside them,
  whatever training.grad_sync says.
- Activations of the micro-batches in flight (a micro-batch: the per-data-rank batch / grad_accum_steps samples;
  under PP grad_accum_steps IS the schedule's number of micro-batches m), each its stage's blocks' saved tensors:
  GPipe: all m forwards before any backward; 1F1B (torch's Schedule1F1B): stage s runs min(m, pp - s) forwards
  before its first backward and then alternates backward, forward, so the first stage holds the most;
  Interleaved1F1B (torch's ScheduleInterleaved1F1B and its _get_warmup_ops): rank r runs
  w = min((V - 1) x m_round + 2 x (pp - 1 - r), m x V) warm-up forwards (m_round = m // max(1, m // pp)), then
  forward, backward pairs, so it holds min(w + 1, m x V) (virtual stage, micro-batch) activations, each counted as
  its largest stage's. Under activation checkpointing one recomputed block comes on top, once. The loss's saved
  tensors (last stage: the whole logits, training.loss_chunks is 1 under PP, which the schedule keeps as the
  stage's output, and their fp32 log-softmax): m of them under GPipe, 1 under the 1F1B schedules (the last stage
  runs forward, backward back to back). An hf model's stages (pipeline_stages.py) are counted as transformers'
  blocks save their tensors (hf_stage_activation_bytes), with the rotary cos and sin each stage computes.
- The peak is the larger of the last backward (state without gradient shards, gathered stages, unsharded
  gradients, activations, and on the last stage the loss's backward) and the reduce-scatter after it (gradient
  shards appear while the unsharded gradients are still there). Both are upper bounds: the first micro-batches'
  activations are freed before the last backward.

The bubble (idle fraction of each rank's step): (pp - 1) / (m + pp - 1) for GPipe and 1F1B: the pipeline fills in
pp - 1 slots and drains in as many, around m slots of work (GPipe, Huang et al. 2019, and Narayanan et al. 2021,
arXiv 2104.04473 section 2.2: bubble time (p - 1) / m of the ideal); (pp - 1) / (V x m + pp - 1) for
Interleaved1F1B, whose V virtual stages per rank shrink each slot V times (the same paper, section 2.2.2).

The zero-bubble schedules (InterleavedZeroBubble = ZB-H1 interleaved, ZBVZeroBubble: Qi et al. 2024, arXiv
2401.10241; DualPipeV: DeepSeek-V3's DualPipe cut in half, arXiv 2412.19437) split each backward into the input
gradient and the weight gradient, run later in the bubble. ZBVZeroBubble and DualPipeV place exactly 2 stages per rank
in a V (rank r: stages r and 2 pp - 1 - r, so rank 0 holds the embedding and the output layer). Their bubble and
in-flight counts are those of torch's own action tables run in unit time (a stage's forward, input gradient and weight
gradient one unit each, the papers' cost model; tests/test_plan_pp.py checks every accepted setup against torch):
idle pp - 1 units of 3 x V x m (ZBVZeroBubble: max(pp - 1, 2 x (2 pp - 1 - m)) of 6 x m, its V's warm-up partly empty
below 2 pp - 1 micro-batches); a stage's activations are held until its weight gradient: InterleavedZeroBubble
min((V - 1) x m_round + pp, m x V) on every rank, ZBVZeroBubble min(2 m, m + 1 + r, 2 pp), DualPipeV 2 pp + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsdp2gen.plan_activations import (
    block_activation_bytes,
    grouped_backward_bytes,
    head_activation_bytes,
    hf_tp_split_bytes,
    loss_backward_bytes,
    op_level_kept_bytes,
    routed_kept_bytes,
    tp_share_saved,
)
from fsdp2gen.plan_families import (
    HfShape,
    hf_block_with_lora_bytes,
    is_trainable,
    lora_op_level_delta,
)
from fsdp2gen.plan_layout import AC_MODES, layout_module, request_shard_numel
from fsdp2gen.plan_shapes import COMPUTE_BYTES, EMBEDDINGS, FP32, INT64, in_block, parameter_shapes

# parallel.pp_schedule's choices (the generated project's config), and what each needs of V, as the project's layout.py
# says: several stages per rank (2 or more), of which the V-shaped ones place exactly 2 (rank r: r and 2 pp - 1 - r).
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = layout_module().MULTI_STAGE_SCHEDULES
V_SHAPED = layout_module().V_SCHEDULES


@dataclass(frozen=True)
class RankStages:
    """One pipeline rank's share: its stage indices, each stage's block indices, and its per-GPU figures."""

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[range, ...]
    in_flight: int  # (stage, micro-batch) activations held at once
    per_gpu: dict[str, int]
    activations: dict[str, int]
    host: int  # with --cpu-offload: the state that lives in CPU memory

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def holds(self) -> str:
        """Its blocks and the root parameters it holds, e.g. 'blocks 0-15 + embedding'."""
        parts = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in self.blocks]
        return f"block{'s' if sum(map(len, self.blocks)) > 1 else ''} {', '.join(parts)}"


def block_index(name: str) -> int:
    """The index of the block parameter `name` is in: llama's layers.N.*, hf's model.layers.N.*."""
    return int(name.removeprefix("model.").split(".")[1])


def stage_layers(n_layers: int, stages: int, layers: tuple[int, ...] = ()) -> list[range]:
    """Each stage's block indices: parallel.pp_layers' counts, or an even split whose remainder goes one block
    each to the first stages."""
    counts = list(layers) or [n_layers // stages + (i < n_layers % stages) for i in range(stages)]
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def bubble_fraction(pp: int, micro_batches: int, schedule: str, stages_per_rank: int) -> float:
    """The idle fraction of each rank's step (the module docstring's formulas). The zero-bubble schedules count in
    thirds of a stage's micro-batch (forward, input gradient, weight gradient): 3 x V x m of them per rank."""
    m, v = micro_batches, stages_per_rank
    if schedule in ("1F1B", "GPipe", "Interleaved1F1B"):
        slots = m * (v if schedule == "Interleaved1F1B" else 1)
        return (pp - 1) / (slots + pp - 1)
    idle = pp - 1
    if schedule == "ZBVZeroBubble":  # fewer than 2 pp - 1 micro-batches leave the V's warm-up partly empty
        idle = max(pp - 1, 2 * (2 * pp - 1 - m))
    return idle / (3 * v * m + idle)


def pipeline_bubble(request: Any) -> float:
    """bubble_fraction of the request's pipeline."""
    return bubble_fraction(request.pp, request.grad_accum_steps, request.pp_schedule, request.pp_stages_per_rank)


def bubble_formula(schedule: str, stages_per_rank: int) -> str:
    """bubble_fraction's formula as plan prints it."""
    if schedule in ("1F1B", "GPipe", "Interleaved1F1B"):
        return f"(pp - 1) / ({'V x ' if stages_per_rank > 1 else ''}m + pp - 1)"
    if schedule == "ZBVZeroBubble":
        return "b / (6 x m + b), b = max(pp - 1, 2 x (2 pp - 1 - m))"
    return "(pp - 1) / (3 x V x m + pp - 1)"


def in_flight(schedule: str, pp: int, rank: int, micro_batches: int, stages_per_rank: int) -> int:
    """(stage, micro-batch) activations rank `rank` holds at once under `schedule` (the module docstring)."""
    m, v = micro_batches, stages_per_rank
    if schedule == "GPipe":
        return m * v
    if schedule == "1F1B":
        return min(m, pp - rank)
    if schedule == "ZBVZeroBubble":
        return min(2 * m, m + 1 + rank, 2 * pp)
    if schedule == "DualPipeV":
        return 2 * pp + 1
    m_round = m // max(1, m // pp)
    if schedule == "InterleavedZeroBubble":  # each rank holds a stage's inputs until its weight gradient
        return min((v - 1) * m_round + pp, m * v)
    warmup = min((v - 1) * m_round + 2 * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v)


def check_pipeline(request: Any) -> str | None:
    """The first problem of the request's pipeline as one line naming the fix, or None (checks run in
    plan._check_request, before anything is estimated)."""
    if request.pp_schedule not in PP_SCHEDULES:
        return f"--pp-schedule {request.pp_schedule}: choose one of {', '.join(PP_SCHEDULES)}"
    if request.pp == 1:
        return None
    return check_pipeline_ranks(request) or check_pipeline_stages(request)


def check_pipeline_ranks(request: Any) -> str | None:
    """The GPUs and the schedule's stages per rank."""
    pp, v, schedule = request.pp, request.pp_stages_per_rank, request.pp_schedule
    if request.world_size % pp:
        fitting = max(d for d in range(1, pp + 1) if request.world_size % d == 0)
        return f"--pp {pp} does not divide {request.world_size} GPUs; choose a divisor, e.g. --pp {fitting}"
    if request.world_size % (pp * request.tp):
        return (
            f"--pp {pp} x --tp {request.tp} does not divide {request.world_size} GPUs; choose degrees whose product "
            "divides it"
        )
    if schedule in V_SHAPED and v != 2:
        return f"--pp-schedule {schedule} places 2 stages per rank (a V), got {v}; give --pp-stages-per-rank 2"
    if schedule in MULTI_STAGE and v < 2:
        return f"--pp-schedule {schedule} needs 2 or more stages per rank, got {v}; give --pp-stages-per-rank 2"
    if schedule not in MULTI_STAGE and v != 1:
        return (
            f"--pp-schedule {schedule} runs 1 stage per rank, got {v}; give --pp-stages-per-rank 1, or "
            "--pp-schedule Interleaved1F1B"
        )
    return None


def check_pipeline_stages(request: Any) -> str | None:
    """The blocks of each stage, tied embeddings, and the schedule's micro-batches (torch's rules)."""
    pp, v, m, schedule = request.pp, request.pp_stages_per_rank, request.grad_accum_steps, request.pp_schedule
    model = request.model
    stages = pp * v
    if model.n_layers < stages:
        return (
            f"--pp {pp} x {v} stages per rank = {stages} stages for {model.n_layers} blocks; each stage needs a block, "
            f"lower --pp or --pp-stages-per-rank"
        )
    layers = request.pp_layers
    if layers and (len(layers) != stages or min(layers) < 1 or sum(layers) != model.n_layers):
        return (
            f"parallel.pp_layers {list(layers)} must give {stages} stages (pp x pp_stages_per_rank) 1 or more blocks "
            f"each, {model.n_layers} in all; fix it in the config, or [] for an even split"
        )
    if model.tie_embeddings:
        return (
            f"--pp {pp}: tied embeddings cannot span the first and the last stage; set model.tie_embeddings = false "
            "or plan with --pp 1"
        )
    if schedule == "1F1B" and m < pp:
        return (
            f"--pp-schedule 1F1B needs at least pp ({pp}) micro-batches, got grad_accum_steps {m}; give "
            f"--grad-accum-steps {pp} or more, or --pp-schedule GPipe"
        )
    return check_pipeline_micro_batches(request)


def check_pipeline_micro_batches(request: Any) -> str | None:
    """torch's rules for the schedule's micro-batches, and where plan's model of InterleavedZeroBubble holds."""
    pp, m, schedule = request.pp, request.grad_accum_steps, request.pp_schedule
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
        rounds = max(1, m // pp)
        return (
            f"--pp-schedule {schedule} needs grad_accum_steps ({m}) to be a multiple of its rounds "
            f"(grad_accum_steps // pp = {rounds}); give --grad-accum-steps {rounds * pp} or a multiple of pp"
        )
    if schedule == "DualPipeV" and m < 2 * pp:
        return (
            f"--pp-schedule DualPipeV needs at least 2 x pp = {2 * pp} micro-batches (its stages), got {m}; give "
            f"--grad-accum-steps {2 * pp} or more"
        )
    if schedule == "InterleavedZeroBubble" and m < pp:
        # torch runs it, but its bubble then follows no formula plan has (measured on torch's schedule tables).
        return (
            f"--pp-schedule InterleavedZeroBubble is planned for at least pp ({pp}) micro-batches, got {m}; give "
            f"--grad-accum-steps {pp} or more"
        )
    return None


def stage_activation_bytes(request: Any, compute: int, ac: str, blocks: range, held: int, last: bool) -> int:
    """Activations of one rank for AC mode `ac`: `held` micro-batches' saved tensors of a stage of `blocks`, one
    recomputed block under AC, and on the last stage the loss's saved tensors (GPipe: every micro-batch's). With
    held = 1 and every block on one stage this equals plan.activation_bytes (tests/test_plan_pp.py)."""

    model, batch, seq, tp = request.model, request.batch, request.local_seq_len, request.tp
    if isinstance(model, HfShape):
        return hf_stage_activation_bytes(request, compute, ac, blocks, held, last)
    block = block_activation_bytes(model, batch, seq, compute, tp)
    block_input = math.ceil(compute * batch * seq * model.dim / tp)
    if ac == "none":
        kept = len(blocks) * block
    elif ac == "full":
        kept = len(blocks) * block_input
    elif ac == "layer":  # blocks whose global index activation_checkpoint_every divides (activation_checkpoint.py)
        checkpointed = sum(1 for i in blocks if i % request.ac_every == 0)
        kept = checkpointed * block_input + (len(blocks) - checkpointed) * block
    else:  # selective: each block keeps its input and its expensive ops' outputs
        kept = len(blocks) * (block_input + op_level_kept_bytes(model, batch, seq, compute, tp))
    recompute = 0 if ac == "none" else block
    losses = (request.grad_accum_steps if request.pp_schedule == "GPipe" else 1) if last else 0
    head = head_activation_bytes(model, batch, seq, compute, tp) + stage_output_bytes(request)
    return held * kept + recompute + losses * head


def stage_output_bytes(request: Any) -> int:
    """The last stage's output, the logits (fp32: the stage root's output_dtype; split by vocabulary under tp),
    which the schedule keeps from a micro-batch's forward to its backward, beside the loss's fp32 log-softmax of
    them (pipeline.py computes the loss of the whole logits: training.loss_chunks is 1 under PP). Without it plan
    was 13% under the simulated step of a 1B llama's last stage (scripts/plan_memory.py)."""
    model = request.model
    return FP32 * request.batch * request.local_seq_len * math.ceil(model.vocab_size / request.tp)


def hf_stage_activation_bytes(request: Any, compute: int, ac: str, blocks: range, held: int, last: bool) -> int:
    """stage_activation_bytes of an hf model's stage (pipeline_stages.py: the model's own forward, its other stages'
    parts stand-ins): per micro-batch in flight its blocks' saved tensors as transformers' blocks save them
    (hf_block_with_lora_bytes: with LoRA's change; selective AC: each block's input and the
    matmul outputs op_level_kept_bytes counts, routed_kept_bytes' in a routed block, with LoRA's: lora_op_level_delta)
    and the rotary cos and sin every stage computes once per forward (compute dtype); one recomputed block under AC.
    The last stage: lm_head's whole logits (training.loss_chunks is 1 under PP), which the stage outputs in the root's
    output dtype (fp32) and the loss keeps with its fp32 log-softmax, with the final norm's one fp32 copy of its input
    (transformers' RMSNorm), its output (lm_head's input) and the targets; m of them under GPipe, else 1.
    With tp > 1 (tensor_parallel.py inside each stage, no sequence parallelism) each block holds 1/tp of what its
    split layers compute (hf_tp_split_bytes: a routed block's experts whole) and the last stage 1/tp of the
    vocabulary's logits (loss_parallel); the blocks' inputs, the norms, lm_head's input and the hidden states the
    stages exchange stay whole."""
    model, batch, seq, tp = request.model, request.batch, request.local_seq_len, request.tp
    tokens = batch * seq
    split = {i: [tp_share_saved(part, tp) for part in hf_tp_split_bytes(model, tokens, compute, i)] for i in blocks}
    one = [hf_block_with_lora_bytes(model, batch, seq, compute, i) - split[i][0] for i in blocks]
    block_input = compute * tokens * model.dim
    if ac == "none":
        kept = sum(one)
    elif ac == "full":
        kept = len(one) * block_input
    elif ac == "layer":
        kept = sum(block_input if i % request.ac_every == 0 else size for i, size in zip(blocks, one, strict=True))
    else:
        matmuls = [(routed_kept_bytes(model, batch, seq, compute) if i in model.moe_layers
                    else op_level_kept_bytes(model, batch, seq, compute)) - split[i][1] for i in blocks]  # fmt: skip
        kept = sum(matmuls) + len(one) * (block_input + lora_op_level_delta(model, batch, seq, compute))
    recompute = 0 if ac == "none" else max(one)
    rotary = 2 * compute * tokens * model.head_dim
    # A stage before the last: the schedule keeps each micro-batch's output (the hidden states, in the stage root's
    # output dtype, fp32) from its forward to its backward.
    output = 0 if last else FP32 * tokens * model.dim
    return held * (kept + rotary + output) + recompute + hf_stage_head_bytes(request, compute, last)


def hf_stage_head_bytes(request: Any, compute: int, last: bool) -> int:
    """The last stage's loss-side saved tensors (hf_stage_activation_bytes), freed by the loss's backward, before the
    blocks' (m of them under GPipe, else 1); 0 on the other stages."""
    if not last:
        return 0
    model, tokens, tp = request.model, request.batch * request.local_seq_len, request.tp
    losses = request.grad_accum_steps if request.pp_schedule == "GPipe" else 1
    head = (FP32 + compute) * tokens * model.dim + FP32 * tokens  # the final norm
    head += compute * tokens * model.dim + INT64 * tokens  # lm_head's input, the targets
    # The log-softmax (this rank's vocabulary under tp), and the logits.
    head += FP32 * tokens * math.ceil(model.vocab_size / tp) + stage_output_bytes(request)
    return losses * head


def hf_block_backward_bytes(request: Any, compute: int, received: bool) -> int:
    """The temporaries of a dense hf block's backward at its peak (inside the post-attention RMSNorm's backward, as
    the simulated step of a stage finds it): the gradients of the hidden states, seven in fp32 (transformers' RMSNorm
    computes in fp32; the gradient of the stage's fp32 output) and four in the compute dtype, and three of the MLP's
    hidden units (this tp rank's). The stage's output gradient is a receive buffer (pipeline_buffers) on a rank
    whose stages all come before the last (`received`): six fp32 of its own there. Beside the loss's backward on the
    last stage (stage_peak), it decides a stage before the last: without it plan was 18% under the first stage's
    simulated step (Llama 3.1 70B, tp 8); with the received gradient counted twice, 10.6% over it at 4 blocks (8.4%
    without), once the first stage no longer held the embedding's whole gradient (tensor_parallel.py splits it by its
    dimension), which had hidden the excess."""
    model, tokens = request.model, request.batch * request.local_seq_len
    hidden = (6 if received else 7) * FP32 + 4 * compute
    return tokens * (hidden * model.dim + 3 * compute * math.ceil(model.ffn_dim / request.tp))


def rank_stages(request: Any) -> list[RankStages]:
    """Every pipeline rank's stages and per-GPU figures (the module docstring's model)."""

    pp, v = request.pp, request.pp_stages_per_rank
    layers = stage_layers(request.model.n_layers, pp * v, request.pp_layers)
    shapes = parameter_shapes(request.model, request.tp)
    # The project's own placement (layout.py): round-robin, or the V of ZBVZeroBubble and DualPipeV.
    placement = layout_module().ParallelLayout(pp, pp=pp, pp_schedule=request.pp_schedule, pp_stages_per_rank=v)
    compute = COMPUTE_BYTES[request.precision]
    return [one_rank(request, rank, tuple(placement.rank_stages(rank)), layers, shapes, compute) for rank in range(pp)]


def rank_parameters(
    shapes: list[tuple[str, tuple[int, ...]]], stages: tuple[int, ...], layers: list[range], last_stage: int
) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) of the parameters a rank holding `stages` has: its blocks, the embedding on the first
    stage, the final norm and output layer on the last."""

    mine = {i for s in stages for i in layers[s]}

    def holds(name: str) -> bool:
        if in_block(name):
            return block_index(name) in mine
        return (0 in stages) if name in EMBEDDINGS else (last_stage in stages)

    return [(name, shape) for name, shape in shapes if holds(name)]


def one_rank(
    request: Any,
    rank: int,
    stages: tuple[int, ...],
    layers: list[range],
    shapes: list[tuple[str, tuple[int, ...]]],
    compute: int,
) -> RankStages:
    """Pipeline rank `rank`'s figures, for its `stages`."""
    model, pp, v, m = request.model, request.pp, request.pp_stages_per_rank, request.grad_accum_steps
    last_stage = pp * v - 1
    own = rank_parameters(shapes, stages, layers, last_stage)
    # With LoRA only the adapters have gradients and AdamW state; FSDP gathers the frozen weights all the same.
    trained = [(name, shape) for name, shape in own if is_trainable(model, name)]
    sharded = sum(request_shard_numel(request, name, shape) for name, shape in own)
    sharded_trained = sum(request_shard_numel(request, name, shape) for name, shape in trained)
    gathered = sum(math.prod(shape) for _, shape in own)
    last = last_stage in stages
    held = in_flight(request.pp_schedule, pp, rank, m, v)
    # Interleaved: the rank's in-flight (stage, micro-batch) pairs, each counted as its largest stage's.
    largest = max((layers[s] for s in stages), key=len)
    activations = {mode: stage_activation_bytes(request, compute, mode, largest, held, last) for mode in AC_MODES}
    state = {
        "parameters": FP32 * sharded,
        "gradients": FP32 * sharded_trained,
        "optimizer_state": 2 * FP32 * sharded_trained + FP32 * len(trained),
    }
    # The last stage computes the loss of the whole logits (training.loss_chunks is 1 under PP).
    loss_backward = loss_backward_bytes(model, request.batch, request.local_seq_len, compute, request.tp, 1)
    per_gpu = {name: 0 if request.offload else size for name, size in state.items()}
    per_gpu |= {
        # rotary's tables: llama's cos and sin; an hf model's inverse frequencies and transformers' copy of them.
        "model_buffers": 2 * FP32 * (1 if isinstance(model, HfShape) else model.max_seq_len) * (model.head_dim // 2),
        "all_gather_buffers": compute * gathered,
        "reduce_scatter_buffers": request.reduce_bytes * largest_unit(trained),
        "deferred_gradients": request.reduce_bytes * sum(math.prod(shape) for _, shape in trained),
        "ring_attention": 0,
        "all_to_all_buffers": 0,
        # A stage with routed blocks: the grouped GEMM's backward copies of one of them, in the last backward.
        "experts_backward": grouped_backward_bytes(model, request.batch * request.local_seq_len, compute)
        if set(model.moe_layers) & {i for s in stages for i in layers[s]}
        else 0,
        "loss_backward": loss_backward if last else 0,
        "activations": activations[request.ac],
    }
    extra, head = hf_stage_buffers(request, stages, compute) if isinstance(model, HfShape) else ({}, 0)
    per_gpu |= extra
    per_gpu["total"] = stage_peak(per_gpu, head)
    host = sum(state.values()) if request.offload else 0
    return RankStages(rank, stages, tuple(layers[s] for s in stages), held, per_gpu, activations, host)


def largest_unit(trained: list[tuple[str, tuple[int, ...]]]) -> int:
    """The values of the largest FSDP unit's trained parameters (a block's, or the root's) of a rank's stages."""
    units: dict[int, int] = {}
    for name, shape in trained:
        unit = block_index(name) if in_block(name) else -1
        units[unit] = units.get(unit, 0) + math.prod(shape)
    return max(units.values(), default=0)


def hf_stage_buffers(request: Any, stages: tuple[int, ...], compute: int) -> tuple[dict[str, int], int]:
    """An hf model's rank's pipeline receive buffers and a block's backward temporaries (per_gpu rows), and the last
    stage's loss-side saved tensors (stage_peak's `head`). torch.distributed.pipelining allocates every micro-batch's
    receive buffers at the first step and keeps them (stage.py's _RecvInfo): a stage after the first its inputs', one
    before the last its outputs' gradients', each the hidden states in the stages' fp32 output dtype."""
    last_stage = request.pp * request.pp_stages_per_rank - 1
    receives = sum((stage > 0) + (stage < last_stage) for stage in stages)
    hidden = FP32 * request.batch * request.local_seq_len * request.model.dim
    rows = {"pipeline_buffers": receives * request.grad_accum_steps * hidden,
            "block_backward": hf_block_backward_bytes(request, compute, last_stage not in stages)}  # fmt: skip
    return rows, hf_stage_head_bytes(request, compute, last_stage in stages)


def stage_peak(per_gpu: dict[str, int], head: int = 0) -> int:
    """A rank's peak: the largest of the loss's backward (the last stage: every in-flight activation and the loss's
    saved tensors, `head` of them, with the logits' gradients), a block's backward in its last micro-batch (the loss's
    saved tensors freed; the block's temporaries, a routed block's experts' backward copies) and the reduce-scatter
    after it, all over the state, the stages' gathered parameters, unsharded gradients and receive buffers."""
    base = sum(per_gpu[k] for k in ("parameters", "optimizer_state", "model_buffers"))
    base += per_gpu["all_gather_buffers"] + per_gpu["deferred_gradients"] + per_gpu.get("pipeline_buffers", 0)
    in_loss = base + per_gpu["activations"] + per_gpu["loss_backward"]
    in_blocks = base + per_gpu["activations"] - head
    in_blocks += max(per_gpu["experts_backward"], per_gpu.get("block_backward", 0))
    return max(in_loss, in_blocks, at_reduce(per_gpu))


def at_reduce(per_gpu: dict[str, int]) -> int:
    """A rank's memory at the reduce-scatter after its last backward: the gradient shards appear while the unsharded
    gradients are still there."""
    base = sum(per_gpu[k] for k in ("parameters", "optimizer_state", "model_buffers"))
    base += per_gpu["all_gather_buffers"] + per_gpu["deferred_gradients"] + per_gpu.get("pipeline_buffers", 0)
    return base + per_gpu["gradients"] + per_gpu["reduce_scatter_buffers"]


def worst(ranks: list[RankStages]) -> RankStages:
    """The rank with the largest total (the first of equals)."""
    return max(ranks, key=lambda r: (r.per_gpu["total"], -r.rank))


def describe(request: Any, rank: RankStages) -> str:
    """'rank 0 (stage 0: blocks 0-15 + embedding, 8 micro-batches in flight)'."""
    extra = []
    if rank.first:
        extra.append("embedding")
    if request.pp * request.pp_stages_per_rank - 1 in rank.stages:
        extra.append("norm + output + loss")
    stages = ", ".join(map(str, rank.stages))
    return (
        f"pipeline rank {rank.rank} (stage{'s' if len(rank.stages) > 1 else ''} {stages}: {rank.holds}"
        + "".join(f" + {e}" for e in extra)
        + f"; {rank.in_flight} {'(stage, micro-batch)' if len(rank.stages) > 1 else 'micro-batch'} activations "
        "in flight)"
    )
