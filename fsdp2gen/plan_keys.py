"""Which keys of a generated project's config.toml change the memory of a training step, and how `plan --config`
reads each of them: the planner plans a project as configured, not as its answers or plan's flags default it.

CONFIG_KEYS names every key of config.py's sections (and ModelArgs') for every answer, once:

- READ: the key changes memory and plan_config.py reads it into the PlanRequest (a flag given overrides it);
- NOTED: it changes memory in a way plan does not model; plan reads it and, off its default, says so under the plan
  (PlanRequest.unmodelled), so a figure is never silently that of another setup;
- any other text: why the key does not change the step's GPU memory.

tests/test_plan_config_keys.py walks the schema of every generated example (config.py's dataclasses): a key missing
here fails it, and each READ or NOTED key, set off its default in a project's config.toml, must change the request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp2gen.plan_layout import AC_MODES, PlanError

READ = "read"
NOTED = "noted"

# The model's shape: every ModelArgs key is read (plan_config.py's _model_keys refuses one it does not know); these
# set no shape. (model.hf_checkpoint, which no example has, is read there too: the shape of its config.json.)
NOT_A_SHAPE = "an initialisation or a scale of the same tensors"
CONFIG_KEYS: dict[str, str] = {
    # [job], [eval], [profile], [checkpoint], [data] (but the mask), [wandb]: around the step, not in it.
    **dict.fromkeys(
        ("job.device", "job.output_dir", "job.log_every", "job.timeout_minutes", "job.tensorboard", "job.wandb"),
        "logging and the process group's settings",
    ),  # fmt: skip
    **dict.fromkeys(("wandb.project", "wandb.name", "wandb.tags", "wandb.mode"), "logging"),
    "eval.every": "evaluation runs without gradients, below the training step's peak",
    "eval.batches": "evaluation runs without gradients, below the training step's peak",
    "profile.start": "the profiler's records live in CPU memory",
    "profile.steps": "the profiler's records live in CPU memory",
    "profile.memory_snapshot_step": "the allocator's history lives in CPU memory",
    **dict.fromkeys(
        (
            "checkpoint.interval",
            "checkpoint.keep_last",
            "checkpoint.model_only_final",
            "checkpoint.resume",
            "checkpoint.save_format",
        ),
        "checkpoints are written between steps (plan reports rank 0's CPU memory for a full one)",
    ),  # fmt: skip
    "data.path": "where the tokens come from, not how many",
    "data.tokenizer": "where the tokens come from, not how many",
    "data.synthetic_samples": "where the tokens come from, not how many",
    "data.document_mask": READ,  # refused with cp > 1, as the project's preflight refuses it
    # [training]
    "training.global_batch_size": READ,
    "training.seq_len": READ,
    "training.grad_accum_steps": READ,
    "training.grad_sync": READ,
    "training.loss_chunks": READ,
    **dict.fromkeys(
        (
            "training.steps",
            "training.seed",
            "training.lr",
            "training.lr_min_ratio",
            "training.warmup_steps",
            "training.weight_decay",
        ),
        "the optimizer's schedule, not its state",
    ),
    "training.max_norm": "clipping reduces each gradient shard to a scalar in place",
    # [parallel]
    **dict.fromkeys(
        (
            "parallel.dp_replicate",
            "parallel.dp_shard",
            "parallel.tp",
            "parallel.cp",
            "parallel.ep",
            "parallel.pp",
            "parallel.pp_schedule",
            "parallel.pp_stages_per_rank",
            "parallel.pp_layers",
            "parallel.activation_checkpointing",
            "parallel.activation_checkpoint_every",
            "parallel.cpu_offload",
            "parallel.prefetch_blocks",
            "parallel.reshard_after_forward",
            "parallel.reduce_dtype",
        ),
        READ,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "parallel.output_dtype",
            "parallel.compile",
            "parallel.float8",
            "parallel.shard_modules",
        ),
        NOTED,
    ),  # fmt: skip
    # [model]: llama's ModelArgs (model.size's shape and its overrides), hf's model folder.
    **dict.fromkeys(
        (
            "model.size",
            "model.vocab_size",
            "model.dim",
            "model.n_layers",
            "model.n_heads",
            "model.n_kv_heads",
            "model.ffn_dim",
            "model.max_seq_len",
            "model.tie_embeddings",
            "model.n_experts",
            "model.top_k",
            "model.moe_ffn_dim",
            "model.n_shared_experts",
            "model.n_dense_layers",
            "model.path",
        ),
        READ,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "model.init_std",
            "model.rope_theta",
            "model.rope_type",
            "model.rope_factor",
            "model.rope_low_freq_factor",
            "model.rope_high_freq_factor",
            "model.rope_original_max_seq_len",
            "model.norm_eps",
            "model.route_scale",
            "model.score_func",
            "model.expert_bias_rate",
        ),
        NOT_A_SHAPE,
    ),  # fmt: skip
    # moe.py's balance loss keeps one fp32 per token and MoE layer (the scores' sums): below the plan's rounding.
    "model.aux_loss_coef": "one fp32 per token and MoE layer when > 0, not counted",
    "model.pretrained": "the weights are loaded before the first step, into the same shards",
    # [lora] (hf): read by plan_families.py's read_lora.
    "lora.rank": READ,
    "lora.target_modules": READ,
    "lora.dropout": READ,
    "lora.alpha": "a scale of the adapters' output",
}

# The NOTED keys: their defaults (config.py's) and what plan leaves out when a project changes them.
NOTED_DEFAULTS: dict[str, tuple[Any, str]] = {
    "output_dtype": ("float32", "the root's output cast not modelled"),
    "compile": (False, "planned eager: inductor's fusions save fewer activations, its workspace not counted"),
    "float8": (False, "planned in the compute dtype: float8 casts and scales not counted"),
    "shard_modules": (None, "planned with one FSDP unit per block, as the template's default"),
}


# The end of a message about a value in a project's config.toml (plan_config.py's FIX_CONFIG).
FIX = "fix that value in the file"


def parallel_settings(path: Path, parallel: dict[str, Any], answers: dict[str, Any]) -> dict[str, Any]:
    """The PlanRequest fields of config.toml's [parallel] memory keys (CONFIG_KEYS' READ ones but the degrees, which
    plan_config.py reads), each absent key at config.py's default for the project's answers (dp_replicate: its
    nodes; activation_checkpointing and cpu_offload: its answers), and the NOTED keys off their defaults."""
    settings: dict[str, Any] = {
        "dp_replicate": parallel.get("dp_replicate", answers.get("nodes", 1)),
        "dp_shard": parallel.get("dp_shard", -1),
        "ac_every": parallel.get("activation_checkpoint_every", 2),
        "prefetch_blocks": parallel.get("prefetch_blocks", 1),
    }
    for key, value in settings.items():
        low = -1 if key == "dp_shard" else 0 if key == "prefetch_blocks" else 1
        if type(value) is not int or value < low or value == 0 and key == "dp_shard":
            name = {"ac_every": "activation_checkpoint_every"}.get(key, key)
            raise PlanError(f"{path}: parallel.{name} must be an int of at least {low}, got {value!r}; {FIX}")
    reshard = parallel.get("reshard_after_forward", True)
    if not isinstance(reshard, bool) and (type(reshard) is not int or reshard < 1):
        raise PlanError(f"{path}: parallel.reshard_after_forward must be true, false or an int of at least 1, got "
                        f"{reshard!r}; {FIX}")  # fmt: skip
    settings["reshard_after_forward"] = reshard
    reduce_dtype = parallel.get("reduce_dtype", "float32")
    if reduce_dtype not in ("float32", "bfloat16", "float16"):
        raise PlanError(f"{path}: parallel.reduce_dtype must be one of float32, bfloat16, float16, got "
                        f"{reduce_dtype!r}; {FIX}")  # fmt: skip
    settings["reduce_dtype"] = reduce_dtype
    ac = parallel.get("activation_checkpointing", answers.get("activation_checkpointing", "none"))
    if ac not in AC_MODES:
        raise PlanError(f"{path}: parallel.activation_checkpointing must be one of {', '.join(AC_MODES)}, got {ac!r}; "
                        f"{FIX}")  # fmt: skip
    offload = parallel.get("cpu_offload", answers.get("cpu_offload", False))
    if type(offload) is not bool:
        raise PlanError(f"{path}: parallel.cpu_offload must be true or false, got {offload!r}; {FIX}")
    unmodelled = []
    for key, (default, left_out) in NOTED_DEFAULTS.items():
        value = parallel.get(key, default)
        if key == "shard_modules" and value in (None, [], [answers.get("block_class") or "TransformerBlock"]):
            continue
        if value != default or type(value) is not type(default):
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            unmodelled.append(f"parallel.{key} = {shown}: {left_out}")
    return settings | {"ac": ac, "offload": offload, "unmodelled": tuple(unmodelled)}
