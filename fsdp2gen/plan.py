"""`fsdp2gen plan`: per-GPU memory of FSDP2 training of a generated project, before launching it.

The planner by job (no module imports one above it in this list):

- plan_shapes.py: model shapes and parameter counts;
- plan_layout.py: the request (PlanRequest) and its mesh arithmetic, as the project's layout.py lays ranks out;
- plan_activations.py: what autograd keeps for backward;
- plan_pp.py: pipeline parallelism's stages and schedules;
- plan_memory.py: the step's peak per GPU (the modelling notes are there) and what the allocator reserves;
- plan_levers.py: the changes that would make a plan fit;
- plan_config.py, plan_request.py: reading a project's config.toml, the options, their checks;
- plan_report.py: text and JSON;
- this module: estimate (a plan with its levers) and the --cp-sweep, and the entry points the CLI calls.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp2gen.plan_families import (
    HfShape,
)
from fsdp2gen.plan_layout import PlanError, PlanRequest, cp_takes
from fsdp2gen.plan_levers import find_levers
from fsdp2gen.plan_memory import Plan, memory_plan
from fsdp2gen.plan_report import format_cp_sweep, format_cp_sweep_json, format_json, format_text
from fsdp2gen.plan_request import build_request
from fsdp2gen.plan_shapes import has_experts

# What the CLI and the benchmarks call: the request from the options, the plan, and its text or JSON.
__all__ = [
    "PlanError",
    "PlanRequest",
    "Plan",
    "build_request",
    "estimate",
    "cp_sweep",
    "format_text",
    "format_json",
    "format_cp_sweep",
    "format_cp_sweep_json",
]


def estimate(request: PlanRequest, with_levers: bool = True) -> Plan:
    """The plan of `request`, with the levers that would make it fit where it does not."""
    plan = memory_plan(request)
    if with_levers and not plan.fits:
        plan.levers = find_levers(plan)
    return plan


# `plan --cp-sweep`: the sequence lengths (32k to 256k tokens) and context-parallel degrees it tabulates.
SWEEP_SEQ_LENS = (32768, 65536, 131072, 262144)


SWEEP_CPS = (1, 2, 4, 8)


def cp_sweep(request: PlanRequest) -> list[Plan]:
    """The plan of `request` at every sequence length of SWEEP_SEQ_LENS with every cp of SWEEP_CPS that the GPUs
    allow (cp x tp dividing them) and the project takes (cp_takes), each forward keeping the request's micro-batch
    of whole samples. A model whose max_seq_len is shorter is planned with its rotary tables that long."""
    if isinstance(request.model, HfShape):
        raise PlanError("--cp-sweep: plan models context parallelism for family llama only; plan a llama with --size")
    if has_experts(request.model):
        raise PlanError(
            f"--cp-sweep: mixture-of-experts models are not built for cp > 1; plan {request.label} without --cp-sweep"
        )
    if request.pp > 1:
        raise PlanError(f"--cp-sweep: --pp {request.pp} with cp > 1 is not built; use --pp 1 or drop --cp-sweep")
    plans = []
    for seq_len in SWEEP_SEQ_LENS:
        for cp in SWEEP_CPS:
            ranks = cp * request.tp * request.dp_replicate  # HSDP's copies keep their GPUs
            if request.world_size % ranks or not cp_takes(seq_len, cp, request.tp, request.loss_chunks):
                continue
            model = replace(request.model, max_seq_len=max(request.model.max_seq_len, seq_len))
            changed = replace(request, model=model, seq_len=seq_len, cp=cp, micro_batch=request.batch)
            plans.append(memory_plan(changed))
    return plans
