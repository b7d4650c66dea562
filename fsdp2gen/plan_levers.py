"""The levers of a plan that does not fit: each single change that lowers the per-GPU total."""

from __future__ import annotations

from dataclasses import replace

from fsdp2gen.plan_families import (
    HfShape,
)
from fsdp2gen.plan_layout import AC_MODES, PlanRequest, cp_takes, ep_takes
from fsdp2gen.plan_memory import Lever, Plan, memory_plan
from fsdp2gen.plan_shapes import has_experts


def find_levers(plan: Plan) -> list[Lever]:
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
    if isinstance(request.model, HfShape):
        # An hf project offers expert parallelism of an MoE model's declared plan (not with --tp or LoRA); no cp, pp.
        if has_experts(request.model) and request.tp == 1 and request.model.lora is None:
            options += _ep_levers(plan)
    elif has_experts(request.model):
        options += _ep_levers(plan)
    else:
        options += _cp_levers(plan) if request.pp == 1 else []
        options += _pp_levers(plan)
    if request.dp_replicate > 1:
        # HSDP: sharding over every data rank instead of dp_shard of them divides the state by dp_replicate.
        flat = replace(request, dp_replicate=1, dp_shard=-1)
        options.append((f"--dp-replicate 1 (FSDP over {flat.fsdp_ranks} ranks instead of {request.fsdp_ranks})", flat))
    # More nodes shard the state further under FSDP; under HSDP (dp_replicate = nodes, as a project is generated)
    # they add copies of the same shards, and save only what a smaller micro-batch saves.
    replicas = request.dp_replicate * 2 if request.dp_replicate == request.nodes > 1 else request.dp_replicate
    more = replace(request, nodes=request.nodes * 2, dp_replicate=replicas)
    if request.micro_batch is None and request.global_batch_size is not None:
        if request.global_batch_size % (more.data_ranks * (request.grad_accum_steps or 1)):
            more = replace(more, micro_batch=request.batch)  # the global batch cannot be split further
    copies = f", dp_replicate {replicas}: more copies, the same shards" if replicas > 1 else ""
    options.append((f"--nodes {more.nodes} ({more.world_size} GPUs{copies})", more))
    levers = []
    for option, changed in options:
        total = memory_plan(changed).per_gpu["total"]
        if total < plan.per_gpu["total"]:
            levers.append(Lever(option, plan.per_gpu["total"] - total, total, total <= plan.usable_bytes))
    return sorted(levers, key=lambda lever: -lever.saves_bytes)


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
        if memory_plan(changed).fits:
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
    while (
        request.world_size % (pp * request.tp * request.dp_replicate) == 0
        and request.model.n_layers >= pp * request.pp_stages_per_rank
    ):
        m = max(request.grad_accum_steps or 1, pp * request.pp_stages_per_rank)
        changed = replace(request, pp=pp, micro_batch=request.batch, grad_accum_steps=m, pp_layers=())
        label = f"--pp {pp}" + (f" --grad-accum-steps {m}" if m != request.grad_accum_steps else "")
        label += f" ({request.pp_schedule}, FSDP over {changed.fsdp_ranks} rank(s) per stage)"
        found.append((label, changed))
        if memory_plan(changed).fits:
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
    while request.world_size % (cp * request.tp * request.dp_replicate) == 0 and cp_takes(
        request.seq_len, cp, request.tp, request.loss_chunks
    ):
        factor = cp // request.cp
        changed = replace(request, cp=cp)
        label = f"--cp {cp}"
        if request.micro_batch is None and request.global_batch_size is not None:
            changed = replace(changed, grad_accum_steps=request.grad_accum_steps * factor)
            label += f" ({factor}x the grad_accum_steps)"
        found.append((label, changed))
        if memory_plan(changed).fits:
            break
        cp *= 2
    return found[-1:]
