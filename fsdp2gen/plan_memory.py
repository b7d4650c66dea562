"""`fsdp2gen plan`: per-GPU memory of FSDP2 training of the generated Llama model, before launching it.

The estimate follows what a generated project's train.py and model.py actually do:

- fully_shard keeps each rank's parameter shards in fp32 (the model is built in fp32); with bf16/fp16
  the MixedPrecisionPolicy casts them for compute only, so the shards *are* the master weights
  (no extra copy). Shards are dim-0 chunks padded to ceil(rows / ranks), like FSDP2 allocates them.
- Gradients are reduce-scattered in parallel.reduce_dtype (fp32 by default); the gradient shards are fp32 either way.
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
- `reserved` adds what the GPU holds beyond the live tensors at that peak, a row per source (plan_reserved.py): the
  caching allocator's rounding (measured the same way), its per-stream pools and fragmentation, NCCL's buffers.

The generator must not import torch, so everything here is arithmetic on shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fsdp2gen import plan_pp
from fsdp2gen.plan_activations import (
    activations_by_mode,
    all_to_all_bytes,
    grouped_backward_bytes,
    loss_backward_bytes,
    ring_attention_bytes,
)
from fsdp2gen.plan_families import (
    NF4_BYTES,
    NF4_DEQUANTIZE_BYTES,
    HfShape,
    hf_block_activation_bytes,
    is_nf4,
    is_trainable,
)
from fsdp2gen.plan_layout import (
    GPUS,
    PlanRequest,
    gathered_blocks,
    gathered_numel,
    largest_block,
    request_shard_numel,
)
from fsdp2gen.plan_reserved import largest_request, reserved_rows
from fsdp2gen.plan_shapes import (
    COMPUTE_BYTES,
    EMBEDDINGS,
    FP32,
    active_parameter_count,
    has_experts,
    in_block,
    parameter_count,
    parameter_shapes,
)

# What a plan may allocate of a GPU: the rest is for the CUDA context and what plan_reserved.py's rows count beyond the
# allocated peak (allocator rounding, stream pools and fragmentation, NCCL's buffers).
USABLE_FRACTION = 0.9


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
    # The allocated peak (per_gpu["total"]) plus reserved_rows: what the GPU holds at the peak but the CUDA context.
    reserved: int
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
    # What the GPU holds beyond the live tensors at the peak, by source (plan_reserved.py's RESERVED_ROWS).
    reserved_rows: dict[str, int] = field(default_factory=dict)


def memory_plan(request: PlanRequest) -> Plan:
    """The plan of `request`: its per-GPU figures, without levers (plan.estimate adds them)."""
    if request.pp > 1:
        return pipeline_plan(request)
    model = request.model
    compute = COMPUTE_BYTES[request.precision]
    shapes = parameter_shapes(model, request.tp)
    # With LoRA only the adapters have gradients and AdamW state (the frozen weights are sharded all the same).
    trainable = [(name, shape) for name, shape in shapes if is_trainable(model, name)]
    trained = sum(request_shard_numel(request, name, shape) for name, shape in trainable)
    # Of the whole model (shapes are this tensor-parallel rank's).
    trained_total = sum(math.prod(shape) for name, shape in parameter_shapes(model) if is_trainable(model, name))
    state = {
        "parameters": shard_bytes(request, shapes),
        "gradients": FP32 * trained,
        "optimizer_state": 2 * FP32 * trained + FP32 * len(trainable),
    }
    # Under cp each sequence-linear part is a rank's seq_len / cp tokens; only ring attention's K/V spans it all.
    seq, tp = request.local_seq_len, request.tp
    activations = activations_by_mode(request, compute)
    per_gpu = {name: 0 if request.offload else size for name, size in state.items()}
    per_gpu |= family_buffers(request, shapes, compute, trainable) | {"activations": activations[request.ac]}
    # last_micro_batch: the whole model's gradients (this rank's TP slice), unsharded in reduce_dtype (fp32 default),
    # on the GPU even with offload, from the first micro-batch's backward until the last one's. The shards
    # appear as the unsharded gradients are reduce-scattered and freed: the peak adds the difference (experts: n / ep).
    unsharded = request.reduce_bytes * sum(gathered_numel(request, name, shape) for name, shape in trainable)
    per_gpu["deferred_gradients"] = unsharded - per_gpu["gradients"] if request.defers_gradients else 0
    per_gpu |= _exchange_buffers(request, compute)
    per_gpu["kept_gathered"] = _kept_gathered(request, shapes, compute)
    per_gpu["loss_backward"] = loss_backward_bytes(model, request.batch, seq, compute, tp, request.loss_chunks)
    per_gpu["total"], comm_at_peak = _peak(request, per_gpu, shapes, compute)
    comm_buffers = per_gpu["all_gather_buffers"] + per_gpu["reduce_scatter_buffers"]
    rows = reserved_rows(request, per_gpu["total"], comm_buffers, comm_at_peak, _largest_request(request, compute))
    usable = int(GPUS[request.gpu].memory_bytes * USABLE_FRACTION)
    return Plan(
        request=request,
        parameters=parameter_count(model),
        active_parameters=active_parameter_count(model),
        trainable=trained_total,
        per_gpu=per_gpu,
        activations=activations,
        reserved=per_gpu["total"] + sum(rows.values()),
        reserved_rows=rows,
        host_per_gpu=sum(state.values()) if request.offload else 0,
        # fp32 weights and AdamW's two fp32 moments of every trainable parameter (plus one step count per tensor).
        full_checkpoint_host=FP32 * parameter_count(model) + 2 * FP32 * trained_total + FP32 * len(trainable),
        usable_bytes=usable,
        fits=per_gpu["total"] <= usable,
        levers=[],
    )


def _exchange_buffers(request: PlanRequest, compute: int) -> dict[str, int]:
    """Context parallelism's gathered K/V, expert parallelism's all-to-all, the grouped GEMM's backward copies."""
    model, tokens = request.model, request.batch * request.local_seq_len
    return {
        "ring_attention": ring_attention_bytes(model, request.batch, request.seq_len, compute, request.tp, request.cp),
        "all_to_all_buffers": all_to_all_bytes(model, tokens, compute, request.ep),
        "experts_backward": grouped_backward_bytes(model, tokens, compute),
    }


def pipeline_plan(request: PlanRequest) -> Plan:
    """The plan of a pipeline-parallel request: the worst pipeline rank's figures (plan_pp.py's model)."""
    ranks = plan_pp.rank_stages(request)
    worst = plan_pp.worst(ranks)
    model, per_gpu = request.model, worst.per_gpu
    # The gathered stages stay live the whole step; the reduce-scatter buffer is live at the peak when it is the
    # reduce-scatter after the last backward (plan_pp.stage_peak), cached on its stream otherwise.
    in_backward = per_gpu["total"] != plan_pp.at_reduce(per_gpu)
    comm_buffers = per_gpu["reduce_scatter_buffers"]
    compute = COMPUTE_BYTES[request.precision]
    largest = _largest_request(request, compute)
    rows = reserved_rows(request, per_gpu["total"], comm_buffers, 0 if in_backward else comm_buffers, largest)
    # With LoRA the adapters alone have gradients and AdamW state (and a full checkpoint's optimizer state).
    trained = [math.prod(shape) for name, shape in parameter_shapes(model) if is_trainable(model, name)]
    usable = int(GPUS[request.gpu].memory_bytes * USABLE_FRACTION)
    plan = Plan(
        request=request,
        parameters=parameter_count(model),
        active_parameters=active_parameter_count(model),
        trainable=sum(trained),
        per_gpu=per_gpu,
        activations=worst.activations,
        reserved=per_gpu["total"] + sum(rows.values()),
        reserved_rows=rows,
        host_per_gpu=worst.host,
        full_checkpoint_host=FP32 * parameter_count(model) + 2 * FP32 * sum(trained) + FP32 * len(trained),
        usable_bytes=usable,
        fits=per_gpu["total"] <= usable,
        levers=[],
        pipeline={
            "schedule": request.pp_schedule,
            "stages_per_rank": request.pp_stages_per_rank,
            "micro_batches": request.grad_accum_steps,
            "bubble_fraction": plan_pp.pipeline_bubble(request),
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
    return plan


def _peak(
    request: PlanRequest, per_gpu: dict[str, int], shapes: list[tuple[str, tuple[int, ...]]], compute: int
) -> tuple[int, int]:
    """The step's peak per GPU, the highest of the three moments of the module docstring, and how much of the
    all-gather and reduce-scatter buffers that moment holds (the rest is cached on FSDP's streams: plan_reserved.py)."""
    # The blocks' backward (the gathered root and blocks and the reduce-scatter buffers, all the activations
    # counted) and the loss's backward, before any block's (only the root is gathered, no reduce-scatter yet, but
    # the logits-sized tensors of loss_backward).
    in_blocks = sum(size for key, size in per_gpu.items() if key != "loss_backward")
    root_unit = sum(math.prod(shape) for name, shape in shapes if not in_block(name))  # llama's or hf's names
    at_step = sum(per_gpu[key] for key in ("parameters", "gradients", "optimizer_state", "model_buffers"))
    in_loss = at_step + per_gpu["deferred_gradients"] + compute * root_unit + per_gpu["activations"]
    in_loss += per_gpu["kept_gathered"]
    in_loss += per_gpu["loss_backward"]
    # The end of backward: every gradient shard but the root's, and the root's unsharded gradients
    # (compute dtype) with their reduce_dtype copy, the reduce-scatter's input (LoRA: a frozen root has none).
    root_trained = sum(
        math.prod(shape) for name, shape in shapes if not in_block(name) and is_trainable(request.model, name)
    )
    at_root_reduce = at_step + per_gpu["deferred_gradients"] + (compute + request.reduce_bytes) * root_trained
    grads = per_gpu["gradients"] if request.grad_accum_steps == 1 else 0
    # One micro-batch: train_step starts with no gradients (zero_grad(set_to_none=True)), and a block's gradient
    # shards appear only as backward frees its activations, so they are not part of the forward/backward peak; they
    # are at the optimizer step, with the parameters and AdamW state.
    comm = per_gpu["all_gather_buffers"] + per_gpu["reduce_scatter_buffers"]
    moments = [
        (in_blocks - grads, comm),
        (in_loss - grads, compute * root_unit),  # the gathered root
        # The root's reduce-scatter input (and at least the optimizer step's).
        (at_root_reduce, request.reduce_bytes * root_unit),
    ]
    if isinstance(request.model, HfShape) and has_experts(request.model):
        # The first blocks' backward, the last ones: nearly every gradient shard is there, and with them the gathered
        # blocks, a block's unsharded gradients (compute dtype: its reduce_dtype copy comes after its backward) and
        # the experts' backward copies (experts_backward), beside one block's activations. A dense model's blocks
        # are small next to its root, whose reduce-scatter comes after; a mixture-of-experts block, all its experts
        # gathered, is not: the simulated step of Qwen3-30B-A3B and of Mixtral 8x7B peaks in block 1's experts
        # with selective AC, where plan was 6% and 12% under without this moment.
        model, tokens = request.model, (request.batch, request.local_seq_len)
        block = max(hf_block_activation_bytes(model, *tokens, compute, i) for i in range(model.n_layers))
        trained = [(name, shape) for name, shape in shapes if is_trainable(model, name)]
        held = comm - request.reduce_bytes * largest_block(request, trained)
        late = at_step + per_gpu["deferred_gradients"] + held + per_gpu["experts_backward"] + block
        moments.append((late, held))
    return max(moments, key=lambda moment: moment[0])


def _kept_gathered(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]], compute: int) -> int:
    """parallel.reshard_after_forward false or N: what the blocks hold between their forward and their backward, at
    the start of backward (every block's forward done, no block's backward): each block gathered (false), or its
    1/N (N smaller than the shard group: FSDP2 reshards it over groups of N ranks), in the compute dtype. The last
    blocks, whose backward comes first, are the all-gather buffers' already."""
    reshard = request.reshard_after_forward
    if reshard is True or (reshard is not False and reshard >= request.fsdp_ranks):
        return 0  # freed after forward (groups as large as the shard group reshard fully: train.py)
    in_flight = 1 + max(1, request.prefetch_blocks)
    held = gathered_blocks(request, shapes)[:-in_flight]
    if reshard is False:
        return compute * sum(held)
    return compute * sum(math.ceil(block / reshard) for block in held)


def _largest_request(request: PlanRequest, compute: int) -> int:
    """The step's largest short-lived allocation (plan_reserved.largest_request): a gathered block, its fp32
    reduce-scatter input, or one loss chunk's fp32 logits."""
    model, tp = request.model, request.tp
    chunk = (
        FP32 * request.batch * math.ceil(request.local_seq_len / request.loss_chunks) * math.ceil(model.vocab_size / tp)
    )
    return largest_request(largest_block(request, parameter_shapes(model, tp)), chunk, compute)


def _buffers(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]], compute: int) -> dict[str, int]:
    """The model's buffers and FSDP2's all-gather and reduce-scatter buffers, per GPU."""
    model = request.model
    block_unit = largest_block(request, shapes)
    root_unit = sum(math.prod(shape) for name, shape in shapes if not in_block(name))
    # Under last_micro_batch with reduce_dtype the compute dtype (fp32 compute, or a 16-bit reduce_dtype) the
    # unsharded gradients of the root and of the block being reduced are the accumulated ones (deferred_gradients).
    # The root's unsharded gradients during the blocks' backward: the output layer's and the final norm's (computed
    # first, reduce-scattered with the root's at the end of backward); an untied embedding's come only then.
    # (llama's tok_embeddings, hf's model.embed_tokens; none in LoRA's trainable subset, which has no root weight.)
    embedding = sum(math.prod(shape) for name, shape in shapes if name in EMBEDDINGS) if not model.tie_embeddings else 0
    root_grads = root_unit - embedding
    deferred_are_them = request.defers_gradients and compute == request.reduce_bytes
    unsharded_grads = 0 if deferred_are_them else compute * (root_grads + block_unit)
    return {
        # rope_cos and rope_sin: fp32 buffers, not sharded; each MoE block's routing biases, token counts and
        # balance-loss sum (fp32, moe.py).
        "model_buffers": 2 * FP32 * model.max_seq_len * (model.head_dim // 2)
        + FP32 * len(model.moe_layers) * (2 * model.n_experts + 1),
        # The root stays gathered through forward and backward; a block and the ones prefetched ahead of it
        # (parallel.prefetch_blocks; 0 leaves FSDP2's implicit prefetch of the next one).
        "all_gather_buffers": compute * (root_unit + (1 + max(1, request.prefetch_blocks)) * block_unit),
        # The output layer's unsharded gradients live until the end of backward; a block's unsharded gradients
        # are copied into a reduce-scatter input in reduce_dtype.
        "reduce_scatter_buffers": unsharded_grads + request.reduce_bytes * block_unit,
    }


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
    nf4 = [(name, shape) for name, shape in shapes if is_nf4(request.model, name)]
    if nf4:
        buffers |= nf4_buffers(request, shapes, compute, nf4)
    return buffers


def shard_bytes(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """The bytes of a rank's parameter shards: fp32 (the master weights), NF4 for QLoRA's frozen weights."""
    model = request.model
    return round(
        sum(
            (NF4_BYTES if is_nf4(model, name) else FP32) * request_shard_numel(request, name, shape)
            for name, shape in shapes
        )  # fmt: skip
    )


def nf4_buffers(
    request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]], compute: int, nf4: list[tuple[str, tuple]]
) -> dict[str, int]:
    """QLoRA: fully_shard gathers the NF4 weights as NF4 (the root and the gathered and prefetched blocks: the others
    in the compute dtype), and each adapted layer dequantizes its whole weight for its matmul, one at a time
    (forward, and again in backward): the largest one's working memory (NF4_DEQUANTIZE_BYTES per value)."""
    model = request.model
    root = sum(math.prod(shape) for name, shape in shapes if not in_block(name))
    block = sum((NF4_BYTES if is_nf4(model, name) else compute) * gathered_numel(request, name, shape)
                for name, shape in shapes if in_block(name, "0."))  # fmt: skip
    return {
        "all_gather_buffers": round(compute * root + (1 + max(1, request.prefetch_blocks)) * block),
        "nf4_dequantize": NF4_DEQUANTIZE_BYTES * max(gathered_numel(request, name, shape) for name, shape in nf4),
    }
