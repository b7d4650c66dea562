"""A plan as the user reads it: text rows, JSON, and the --cp-sweep table."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from fsdp2gen.plan_activations import moe_activation_parts
from fsdp2gen.plan_families import (
    HfShape,
    routed_activation_parts,
)
from fsdp2gen.plan_layout import GPUS, PlanRequest, gathered_numel, request_shard_numel
from fsdp2gen.plan_memory import Plan
from fsdp2gen.plan_pp import bubble_formula
from fsdp2gen.plan_reserved import RESERVED_ROWS
from fsdp2gen.plan_shapes import COMPUTE_BYTES, FP32, GIB, MIB, has_experts, is_expert, parameter_shapes


def _count(parameters: int) -> str:
    """A parameter count as model cards write it: 8.03B, or 4.24M below a billion."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.2f}M"


def _size(count: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
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
    "block_backward": "block backward temporaries (1 block)",
    "pipeline_buffers": "pipeline receive buffers (fp32, m micro-batches)",
    "kept_gathered": "blocks kept gathered forward -> backward",
    "nf4_dequantize": "NF4 dequantization (largest weight, transient)",
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
            f"whole model's {SHORT_DTYPES[request.reduce_dtype]} gradients until the last micro-batch"
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
        *_reserved_rows(plan),
        f"{'reserved (nvidia-smi less the CUDA context)':<48}{_size(plan.reserved):>12}",
    ]
    if request.offload:
        lines.append(f"{'CPU memory per GPU (offloaded state)':<48}{_size(plan.host_per_gpu):>12}")
    lines.append(f"{'rank 0 CPU memory to write a full checkpoint':<48}{_size(plan.full_checkpoint_host):>12}")
    lines += _verdict_lines(plan)
    lines += [f"not modelled: {note}" for note in request.unmodelled]
    return "\n".join(lines)


def _pipeline_lines(plan: Plan) -> list[str]:
    """pp > 1: the schedule, its bubble, and which pipeline rank the figures below are (the worst)."""
    pipeline, request = plan.pipeline, plan.request
    if pipeline is None:
        return []
    v = request.pp_stages_per_rank
    formula = bubble_formula(request.pp_schedule, v)
    return [
        f"pipeline: {request.pp_schedule}, {request.pp} ranks x {v} stage(s) per rank, m = {pipeline['micro_batches']} "
        f"micro-batches (grad_accum_steps) of {request.batch} sample(s); bubble {formula} = "
        f"{pipeline['bubble_fraction']:.1%}; the last stage's loss of the whole logits (training.loss_chunks 1, "
        "the only value a pp project takes)",
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
        + (f" x {request.dp_replicate} copies (HSDP)" if request.dp_replicate > 1 else "")
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
        value = plan.per_gpu.get(key, 0)
        if key == "kept_gathered":
            if not value:
                continue  # parallel.reshard_after_forward true (or pp > 1: plan_pp.py counts the stages gathered)
            if request.reshard_after_forward is not False:
                label = f"blocks kept {request.reshard_after_forward}-way sharded fwd -> bwd"
        if key == "nf4_dequantize" and not value:
            continue  # no QLoRA
        if key == "parameters" and "nf4_dequantize" in plan.per_gpu:
            label = "parameters (NF4 frozen, other fp32 shards)"
        if request.offload and key in ("parameters", "gradients", "optimizer_state"):
            label += " [CPU]"
        if key == "deferred_gradients" and not request.defers_gradients and request.pp == 1:
            continue  # every_micro_batch or no accumulation: the gradients stay sharded
        if key == "ring_attention" and request.cp == 1:
            continue  # no context parallelism: plain SDPA
        if key == "all_to_all_buffers" and request.ep == 1:
            continue  # no expert parallelism: every rank holds every expert
        if key in ("experts_backward", "block_backward", "pipeline_buffers") and not value:
            continue  # no experts; not an hf model's pipeline stage (plan_pp.py)
        if key == "gradients" and request.grad_accum_steps == 1 and not request.offload:
            label += " [after backward]"  # not at the forward/backward peak: see estimate()
        if request.pp > 1 and key == "loss_backward" and not value:
            continue  # not the last stage
        if key == "all_gather_buffers":
            label = label.replace("2 blocks", f"{1 + max(1, request.prefetch_blocks)} blocks")
        if request.pp > 1 and key in PP_ROWS:
            label = PP_ROWS[key]
        if key in ("deferred_gradients", "reduce_scatter_buffers") and request.reduce_dtype != "float32":
            label = label.replace("fp32", SHORT_DTYPES[request.reduce_dtype])  # parallel.reduce_dtype

        rows.append(f"{label:<48}{_size(value):>12}")
    return rows


ORDINALS = {1: "block", 2: "2nd", 3: "3rd"}


def _reserved_rows(plan: Plan) -> list[str]:
    """What the GPU holds beyond the allocated peak, a row per source (plan_reserved.py), those that are not 0."""
    return [
        f"{'+ ' + label:<48}{_size(plan.reserved_rows[key]):>12}"
        for key, label in RESERVED_ROWS.items()
        if plan.reserved_rows.get(key)
    ]


def _activation_rows(plan: Plan) -> list[str]:
    """The activations under every AC mode, so the plan compares them; the one planned is marked (used)."""
    labels = (
        ("none", "no AC"),
        ("selective", "selective AC (op-level)"),
        ("layer", f"layer AC (every {ORDINALS.get(plan.request.ac_every, f'{plan.request.ac_every}th')})"),
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
        if model.lora is not None and model.lora.nf4:
            lines.append(
                "QLoRA: the adapted layers' frozen weights are NF4 (4.13 bits per value with their scales), sharded "
                "and gathered as such; each is dequantized whole for its matmul (nf4_dequantize: the largest one's)"
            )
    if has_experts(model):
        lines += expert_lines(plan)
    if plan.request.task == "sft":
        lines.append(
            "task sft: the memory of pretraining; the prompt's tokens are masked in the targets (-100, no loss), "
            "which have the same int64 shape"
        )
    return lines


def _hf_router_line(model: HfShape) -> str:
    """A transformers MoE block's router and fused experts, and how many experts a token uses."""
    router = model.n_experts * model.dim
    return (
        f"router: {model.n_experts} x {model.dim} (mlp.gate, {router:,} parameters) per MoE block, trained; "
        f"experts: {_count(3 * model.dim * model.moe_ffn_dim * model.n_experts)} per block (gate_up_proj, "
        f"down_proj), {model.top_k} of {model.n_experts} active per token"
    )


def expert_lines(plan: Plan) -> list[str]:
    """A mixture-of-experts model's layout: its experts, where their weights live per GPU, and what one MoE layer
    holds for backward."""
    request, model = plan.request, plan.request.model
    compute = COMPUTE_BYTES[request.precision]
    experts = [(name, shape) for name, shape in parameter_shapes(model) if is_expert(name)]
    shard = FP32 * sum(request_shard_numel(request, name, shape) for name, shape in experts)
    first = experts[: len(experts) // len(model.moe_layers)]  # one MoE block's
    gathered = compute * sum(gathered_numel(request, name, shape) for name, shape in first)
    tokens = request.batch * request.local_seq_len
    hf = isinstance(model, HfShape)
    parts = (
        routed_activation_parts(model, tokens, compute)
        if hf
        else moe_activation_parts(model, tokens, compute, request.ep)
    )
    held = ", ".join(f"{part} {_size(size)}" for part, size in parts.items() if size)
    layout = (
        f"; FSDP-sharded over {request.fsdp_ranks} ranks like every weight (--ep N shares them out: without it each "
        f"GPU gathers all {model.n_experts} experts of a block to compute it)"
        if hf and request.ep == 1
        else f"; ep {request.ep}: {model.n_experts // request.ep} experts per GPU, sharded over dp_shard / ep"
        f"{' x cp' if request.cp > 1 else ''} = {request.fsdp_ranks // request.ep} ranks"
    )
    lines = [
        f"experts: {model.n_experts} per MoE block x {len(model.moe_layers)} blocks, top {model.top_k}"
        + (f" + {model.n_shared_experts} shared" if model.n_shared_experts else "")
        + layout,
        f"expert weights per GPU: {_size(shard)} fp32 shards (of the parameters row), {_size(gathered)} gathered "
        "per MoE block"
        + (
            f" (fully_shard splits dim 0, the {model.n_experts} experts, over {request.fsdp_ranks} ranks: padded to "
            f"{-(-model.n_experts // request.fsdp_ranks)} per rank)"
            if hf and request.ep == 1 and model.n_experts % request.fsdp_ranks
            else ""
        ),
        f"MoE block activations held for backward ({tokens} tokens x top_k {model.top_k} routed copies, balanced "
        f"routing or not): {held}",
    ]
    if hf:
        lines.insert(1, _hf_router_line(model))
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
            "dp_replicate": request.dp_replicate,
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
            "reshard_after_forward": request.reshard_after_forward,
            "reduce_dtype": request.reduce_dtype,
            **_pipeline_setup(request),
        },
        "pipeline": plan.pipeline,
        "per_gpu_bytes": plan.per_gpu,
        "reserved_bytes_per_gpu": plan.reserved,
        "reserved_bytes_by_source": plan.reserved_rows,
        "activations_bytes": plan.activations,
        "host_bytes_per_gpu": plan.host_per_gpu,
        "full_checkpoint_rank0_host_bytes": plan.full_checkpoint_host,
        "gpu": {"name": request.gpu, "memory_bytes": GPUS[request.gpu].memory_bytes, "usable_bytes": plan.usable_bytes},
        "fits": plan.fits,
        "levers": [asdict(lever) for lever in plan.levers],
        "unmodelled": list(request.unmodelled),
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
