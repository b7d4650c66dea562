"""`fsdp2gen plan`'s options checked and turned into a PlanRequest (build_request), with the project's own checks
(model_args.py's, layout.py's) worded with plan's options."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from fsdp2gen import plan_pp
from fsdp2gen.plan_config import FIX_CONFIG, LIMITS, hf_request, project_request, size_request
from fsdp2gen.plan_families import LORA_DEFAULTS, HfShape, tp_unsupported
from fsdp2gen.plan_layout import (
    AC_MODES,
    GPUS,
    GRAD_SYNC_MODES,
    PlanError,
    PlanRequest,
    expert_layout,
    layout_module,
)
from fsdp2gen.plan_pp import MULTI_STAGE, PP_SCHEDULES
from fsdp2gen.plan_shapes import COMPUTE_BYTES, MOE_SIZES, SIZES, has_experts


def _positive(name: str, value: int | None, limit: int) -> None:
    if value is not None and value < 1:
        raise PlanError(f"{name} must be at least 1, got {value}; give {name} 1 or more")
    if value is not None and value > limit:
        raise PlanError(f"{name} must be at most {limit}, got {value}; give {name} {limit} or less")


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
    dp_replicate: int | None = None,
    loss_chunks: int | None = None,
    lora: bool = False,
    lora_rank: int | None = None,
    qlora: bool = False,
) -> PlanRequest:
    """Check the command-line options (raising PlanError) and turn them into a PlanRequest: the model and
    setup of --config's project (every key of its config.toml that changes memory: plan_keys.py) or of --size,
    with the options given overriding them."""
    sources = [flag for flag, value in (("--size", size), ("--config", config), ("--hf-config", hf_config)) if value]
    if len(sources) > 1:
        raise PlanError(f"{' and '.join(sources)} both given; the model comes from one of them")
    numbers = {"--gpus": gpus, "--nodes": nodes, "--tp": tp, "--cp": cp, "--ep": ep, "--batch": batch, "--seq": seq}
    numbers |= {"--pp": pp, "--pp-stages-per-rank": pp_stages_per_rank, "--grad-accum-steps": grad_accum_steps}
    numbers |= {"--dp-replicate": dp_replicate, "--loss-chunks": loss_chunks, "--lora-rank": lora_rank}
    ac = activation_checkpointing
    _check_options(numbers, ac=ac, gpu_type=gpu_type, precision=precision, grad_sync=grad_sync)
    rank = _lora_rank(lora, lora_rank, qlora, hf_config)
    request = _model_request(size=size, config=config, hf_config=hf_config, tp=tp, seq=seq, cp=cp, lora=(rank, qlora))
    given = {"gpus": gpus, "nodes": nodes, "precision": precision, "tp": tp, "cp": cp, "ep": ep, "micro_batch": batch}
    given |= {"grad_sync": grad_sync, "offload": cpu_offload, "ac": ac, "gpu": gpu_type, "loss_chunks": loss_chunks}
    given |= {"dp_replicate": dp_replicate}
    request = replace(request, **{name: value for name, value in given.items() if value is not None})
    request = _loss_chunks(
        _pipeline_request(request, pp, pp_schedule, pp_stages_per_rank, grad_accum_steps), loss_chunks
    )
    _check_request(request, config)
    return request


def _loss_chunks(request: PlanRequest, loss_chunks: int | None) -> PlanRequest:
    """The request with the loss chunks a pipeline takes (1: its last stage computes the whole logits), --loss-chunks
    checked against it and the sequence length."""
    if request.pp > 1 and request.loss_chunks > 1:
        if loss_chunks is not None:  # the project's config.py refuses it too: the last stage computes whole logits
            raise PlanError(f"--loss-chunks {loss_chunks} with --pp {request.pp} is not built (the last pipeline "
                            "stage computes the loss of the whole logits); use --loss-chunks 1 or --pp 1")  # fmt: skip
        request = replace(request, loss_chunks=1)  # a pp project's training.loss_chunks (the only one it takes)
    if loss_chunks is not None and loss_chunks > request.seq_len:  # a config's is checked with its seq_len
        raise PlanError(f"--loss-chunks {loss_chunks} exceeds the sequence length ({request.seq_len}); lower it")
    return request


def _pipeline_request(
    request: PlanRequest, pp: int | None, schedule: str | None, stages_per_rank: int | None, micro_batches: int | None
) -> PlanRequest:
    """The request with the pipeline options given over the project's parallel.pp* keys: a schedule given alone
    takes its own stages per rank (2 for the multi-stage schedules, else 1) unless the project's suit it;
    parallel.pp_layers holds only for the project's own pp and stages per rank; --size's unknown micro-batches are
    pp x V (the fewest every schedule takes)."""
    if schedule is not None and schedule not in PP_SCHEDULES:
        raise PlanError(f"--pp-schedule {schedule}: choose one of {', '.join(PP_SCHEDULES)}")
    changed = replace(request, pp=pp or request.pp, pp_schedule=schedule or request.pp_schedule)
    interleaved = changed.pp_schedule in MULTI_STAGE
    v = stages_per_rank or request.pp_stages_per_rank
    if schedule is not None and stages_per_rank is None and (v >= 2) != interleaved:
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
    numbers: dict[str, int | None], *, ac: str | None, gpu_type: str, precision: str | None, grad_sync: str | None
) -> None:
    """The options' own checks, before any file is read: counts in range, names among the choices."""
    for name, value in numbers.items():
        _positive(name, value, LIMITS[name])
    if ac is not None and ac not in AC_MODES:
        raise PlanError(f"--activation-checkpointing {ac}: choose one of {', '.join(AC_MODES)}")
    if gpu_type not in GPUS:
        raise PlanError(f"--gpu-type {gpu_type}: unknown GPU; choose one of {', '.join(GPUS)}")
    if precision is not None and precision not in COMPUTE_BYTES:
        raise PlanError(f"--precision {precision}: choose one of {', '.join(COMPUTE_BYTES)}")
    if grad_sync is not None and grad_sync not in GRAD_SYNC_MODES:
        raise PlanError(f"--grad-sync {grad_sync}: choose one of {', '.join(GRAD_SYNC_MODES)}")


def _lora_rank(lora: bool, rank: int | None, qlora: bool, hf_config: Path | None) -> int | None:
    """The rank of the LoRA adapters --lora or --qlora ask for (--qlora implies --lora, as `new --qlora` does; the
    template's lora.rank unless --lora-rank), or None without them. They plan --hf-config's model only: a project's
    adapters are its config.toml's [lora] table (and its recorded qlora answer)."""
    flags = [flag for flag, given in (("--lora", lora), ("--qlora", qlora), ("--lora-rank", rank)) if given]
    if flags and hf_config is None:
        raise PlanError(f"{flags[0]} plans adapters on an --hf-config model; a project's are its config.toml's [lora] "
                        "table (--config), and a --size model takes none")  # fmt: skip
    if rank is not None and not (lora or qlora):
        raise PlanError(f"--lora-rank {rank} is the rank of LoRA's adapters; add --lora (or --qlora)")
    return (rank or LORA_DEFAULTS["rank"]) if lora or qlora else None


def _model_request(
    *, size: str | None, config: Path | None, hf_config: Path | None, tp: int | None, seq: int | None, cp: int | None,
    lora: tuple[int | None, bool] = (None, False),
) -> PlanRequest:  # fmt: skip
    """The request of the one model source given (--config, --size or --hf-config), before the options override it;
    `lora`: the rank of --hf-config's adapters (None: none) and whether on an NF4 base."""
    if config is not None:
        return project_request(config, tp, seq, cp)
    if size is not None:
        return size_request(size, seq)
    if hf_config is not None:
        return hf_request(hf_config, seq, *lora)
    raise PlanError(
        f"no model to plan; give --size ({', '.join(SIZES)}), --config PATH/config.toml or --hf-config PATH/config.json"
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
    _check_hf_layout(request)
    _check_pipeline(request)
    # layout.py's checks, as preflight.py runs them, worded with plan's options.
    cp = request.cp
    layout = request.layout
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
        if not isinstance(model, HfShape):  # an hf model's: _check_hf_layout (no sequence parallelism)
            layout.check_tensor_parallel(training, model)
        if request.micro_batch is None and request.global_batch_size is not None:
            layout.check_batch(training)
        if cp > 1:
            layout.check_context_parallel(training)
    except layout_module().LayoutError as error:
        raise PlanError(_plan_wording(error.problem, request)) from None


def _check_hf_layout(request: PlanRequest) -> None:
    """An hf model's tp, cp and pp, as its project's layout.py and tensor_parallel.py check them, and what plan does
    not model with them (ep with tp, which the generator refuses too). A mixture-of-experts model's experts stay
    whole under tp, as the model's declared plan leaves them (plan_activations.hf_tp_split_bytes). LoRA's adapters
    split by tp are planned (plan_families.tp_split_dim); under pp both are (plan_pp.py: a stage's adapters, its
    routed blocks)."""
    model = request.model
    if not isinstance(model, HfShape):
        return
    if request.tp > 1 and request.ep > 1:  # as the generator refuses --ep --tp for an hf model
        raise PlanError(f"--ep {request.ep} with --tp {request.tp} for an hf model is not built (its experts would "
                        "need both meshes); use --ep 1 (tp leaves the experts whole) or --tp 1")  # fmt: skip
    if request.tp > 1:
        if model.lora is not None and model.lora.nf4:  # as the generator refuses --qlora --tp
            raise PlanError(f"--tp {request.tp} with QLoRA is not built (a project's NF4 weights are sharded by "
                            "fully_shard only); use --tp 1, or plan LoRA on an unquantized base")  # fmt: skip
        problem = tp_unsupported(model)
        if problem:
            raise PlanError(f"--tp {request.tp}: {problem} ({model.source}); use --tp 1")
        splits = [("num_attention_heads", model.n_heads), ("num_key_value_heads", model.n_kv_heads)]
        if len(model.moe_layers) < model.n_layers:  # a dense MLP's units (a routed block's experts stay whole)
            splits.append(("intermediate_size", model.ffn_dim))
        for key, value in splits:
            if value % request.tp:
                raise PlanError(f"--tp {request.tp} must divide {key} ({value}, {model.source}), which it splits; "
                                f"e.g. --tp {math.gcd(value, request.tp)}")  # fmt: skip


def _check_pipeline(request: PlanRequest) -> None:
    """Pipeline parallelism's rules (plan_pp.check_pipeline), and what the project does not build with it."""
    if request.pp > 1:
        if isinstance(request.model, HfShape) and request.model.tie_embeddings:
            raise PlanError(
                f"--pp {request.pp}: {request.model.source} ties lm_head to the input embedding (tie_word_embeddings), "
                "one matrix the first and the last stage cannot share; plan an untied copy, or --pp 1"
            )
        if isinstance(request.model, HfShape) and request.model.lora is not None and request.model.lora.nf4:
            # As the generator refuses --qlora --pp: each stage would load and quantize its own blocks.
            raise PlanError(f"--pp {request.pp} with QLoRA is not built (a project's NF4 base is quantized whole); "
                            "use --pp 1, or plan LoRA on an unquantized base")  # fmt: skip
        if isinstance(request.model, HfShape) and request.ep > 1:
            # An hf project builds it (each stage shares out its own layers' experts); plan_pp has no ep figures yet.
            raise PlanError(f"--pp {request.pp} with --ep {request.ep}: plan does not model expert parallelism inside "
                            "pipeline stages yet (an hf project builds it); plan it with --ep 1 (FSDP shards the "
                            "experts) or --pp 1")  # fmt: skip
        for flag, degree in (("--cp", request.cp), ("--ep", request.ep)):
            if degree > 1:
                raise PlanError(f"--pp {request.pp} with {flag} {degree} is not built; use {flag} 1 or --pp 1")
        if has_experts(request.model) and not isinstance(request.model, HfShape):
            raise PlanError(
                f"--pp {request.pp}: the llama family's mixture-of-experts models are not built for pp > 1; use "
                "--pp 1 (--ep splits the experts over GPUs)"
            )
    problem = plan_pp.check_pipeline(request)
    if problem:
        raise PlanError(problem)


def _check_experts(request: PlanRequest) -> None:
    """model_args.py's rules of the mixture-of-experts keys, and expert parallelism's (ep borrows its ranks from
    dp_shard and gives each of them whole experts), worded with plan's options."""
    model, ep = request.model, request.ep
    if isinstance(model, HfShape):
        # The project applies the model's declared ep plan (its expert_parallel.py); transformers declares one for
        # the MoE model types it has, none for dense ones.
        if ep > 1 and not has_experts(model):
            raise PlanError(f"--ep {ep}: {model.source} is not a mixture-of-experts model; use --ep 1")
        if ep > 1 and model.lora is not None:
            # The project trains it (expert_parallel.py splits the experts' adapters by expert); plan's memory
            # model of LoRA on a mixture-of-experts model has its experts frozen whole, not adapted and split.
            raise PlanError(f"--ep {ep}: plan does not model LoRA with expert parallelism yet (its LoRA memory "
                            "model keeps an MoE model's experts frozen and whole); plan with --ep 1")  # fmt: skip
        if ep > 1:
            _check_expert_layout(request, model.n_experts)
        return
    experts = model.n_experts
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
    _check_expert_layout(request, experts)


def _check_expert_layout(request: PlanRequest, experts: int) -> None:
    """layout.py's check of `experts` shared out over request.ep ranks borrowed from dp_shard, in plan's words."""
    if request.ep > 1 and request.world_size == 1:  # layout.py lets one process (a debugging run) hold every expert
        raise PlanError(_plan_wording("ep_ranks", request))
    try:
        expert_layout(request, request.ep).check_expert_parallel(SimpleNamespace(n_experts=experts))
    except layout_module().LayoutError as error:
        raise PlanError(_plan_wording(error.problem, request)) from None


def _plan_wording(problem: str, request: PlanRequest) -> str:
    """layout.py's `problem` with plan's options as the fix."""
    model, tp, cp, seq_len, loss_chunks = request.model, request.tp, request.cp, request.seq_len, request.loss_chunks
    ranks = f"--tp {tp} does not divide {request.world_size} GPUs; choose a divisor"
    if cp > 1:  # the degrees that split each sample's tokens (cp, and tp when there is one) must divide the GPUs
        named = f"--cp {cp}" if tp == 1 else f"--cp {cp} x --tp {tp}"
        fix = "a divisor" if tp == 1 else "degrees whose product divides it"
        ranks = f"{named} does not divide {request.world_size} GPUs; choose {fix}"
    if request.dp_replicate > 1 or request.dp_shard > 0:  # HSDP: its groups must tile the GPUs too
        shard = str(request.dp_shard) if request.dp_shard > 0 else "the rest"
        ranks = (
            f"dp_replicate {request.dp_replicate} x dp_shard ({shard}) x cp {cp} x tp {tp} does not make the "
            f"{request.world_size} GPUs; change --dp-replicate or parallel.dp_replicate / dp_shard"
        )
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
        "ep_ranks": f"--ep {request.ep} must divide the {request.layout.dp_shard} dp_shard ranks it borrows from "
        f"({request.world_size} GPUs{f' / cp {cp}' if cp > 1 else ''}); e.g. --ep {_fitting_ep(request)}",
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
