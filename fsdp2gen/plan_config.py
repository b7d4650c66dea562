"""The request of a model source: a generated project's config.toml and recorded answers, a Hugging Face
config.json, or a `--size`."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp2gen.files import FileInputError, read_text
from fsdp2gen.plan_families import (
    ATTENTION,
    HfConfigError,
    HfShape,
    read_hf_config,
    read_lora,
)
from fsdp2gen.plan_keys import parallel_settings
from fsdp2gen.plan_layout import (
    GRAD_SYNC_MODES,
    TEMPLATE_GRAD_SYNC,
    TEMPLATE_LOSS_CHUNKS,
    TEMPLATE_TRAINING,
    PlanError,
    PlanRequest,
)
from fsdp2gen.plan_pp import MULTI_STAGE
from fsdp2gen.plan_shapes import SIZES, TEMPLATE_MODEL, TEMPLATE_SIZES, TEMPLATE_UNSET
from fsdp2gen.questions import questions, read_answers
from fsdp2gen.sizes import (
    shape_of,
)

# Upper bounds of the inputs: GPUs per node and nodes as the generator's copier.yml bounds them; the rest far
# above any model or run there is, so that a typo (an extra digit or ten) is refused instead of planned, and
# the per-layer arithmetic stays instant. Every input is at least 1.
LIMITS = {"--gpus": 64, "--nodes": 16384, "--tp": 64, "--cp": 64, "--ep": 2**16, "--batch": 2**16, "--seq": 2**24}

LIMITS |= {"--pp": 2**12, "--pp-stages-per-rank": 2**12, "--grad-accum-steps": 2**16}
LIMITS |= {"--dp-replicate": 16384, "--loss-chunks": 2**24, "--lora-rank": 2**20}

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

# The end of a message about a value in a project's config.toml.
FIX_CONFIG = "fix that value in the file"


def _read_config(
    path: Path, model_table: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """([model], [training]) of a generated project's config.toml, and the project's recorded answers
    (`model_table`: read instead of its [model], which an hf project fills with other keys)."""
    raw = read_toml(path)
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
    return model, training, read_answers_file(path.parent / ".copier-answers.yml")


def read_toml(path: Path) -> dict[str, Any]:
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


# A LlamaForCausalLM config.json's shape keys -> ModelArgs' (the project's hf_checkpoint.py maps the same).
HF_LLAMA_SHAPE = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                  "num_key_value_heads": "n_kv_heads", "vocab_size": "vocab_size", "intermediate_size": "ffn_dim",
                  "tie_word_embeddings": "tie_embeddings"}  # fmt: skip


def _hf_checkpoint_shape(path: Path, folder: str) -> dict[str, Any]:
    """The shape keys of model.hf_checkpoint's config.json (the built-in llama started from a Hugging Face
    checkpoint takes its shape from there, as model_args.py does)."""
    config = Path(folder).expanduser() / "config.json"
    try:
        hf = json.loads(read_text(config, "model.hf_checkpoint's config", FIX_CONFIG))
        shape = {ours: hf[key] for key, ours in HF_LLAMA_SHAPE.items() if key in hf}
    except (FileInputError, ValueError, TypeError) as error:
        raise PlanError(f"{path}: model.hf_checkpoint: {config} cannot be read ({error}); {FIX_CONFIG}") from None
    shape.setdefault("n_kv_heads", shape.get("n_heads"))
    return shape


def _model_keys(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    """config.toml's [model] over ModelArgs' defaults, its zeros taken from model.size, as model.py does."""
    model = dict(TEMPLATE_MODEL)
    table = dict(table)
    hf_checkpoint = table.pop("hf_checkpoint", "")
    if hf_checkpoint:
        table |= _hf_checkpoint_shape(path, str(hf_checkpoint))
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


def read_answers_file(answers_file: Path) -> dict[str, Any]:
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
    parallel = read_toml(path).get("parallel", {})
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


def _parallel_settings(path: Path, answers: dict[str, Any]) -> dict[str, Any]:
    """config.toml's [parallel] memory keys but the degrees (plan_keys.py's parallel_settings)."""
    parallel = read_toml(path).get("parallel", {})
    return parallel_settings(path, parallel if isinstance(parallel, dict) else {}, answers)


def _default(name: str, answers: dict[str, Any]) -> Any:
    """The answer the project was generated with, else the template's default (copier.yml)."""
    return answers.get(name, questions()[name].default)


def project_request(config: Path, tp: int | None, seq: int | None, cp: int | None = None) -> PlanRequest:
    """The model, batch and setup of a generated project's config.toml and recorded answers."""
    family = read_answers_file(config.parent / ".copier-answers.yml").get("family", "llama")
    if family == "hf":
        return hf_project_request(config, tp, seq, cp)
    if family != "llama":
        raise PlanError(f"family {family}: only llama and hf are planned; plan a llama of similar shape with --size")
    model_keys, training, answers = _read_config(config)
    cp = _project_cp(config, answers, cp)
    pipeline = _project_pipeline(config, answers)
    return PlanRequest(
        **pipeline,
        **_parallel_settings(config, answers),
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


def _project_cp(config: Path, answers: dict[str, Any], cp: int | None) -> int:
    """The context-parallel degree to plan (--cp, else the project's), refused with data.document_mask as the
    project's preflight (context_parallel.py) refuses it."""
    cp = cp or _project_parallel(config, answers, "cp")
    data = read_toml(config).get("data", {})
    if cp > 1 and isinstance(data, dict) and data.get("document_mask") is True:
        raise PlanError(
            f"{config}: cp {cp} cannot mask documents (ring attention is causal over the whole sequence); set "
            "data.document_mask = false there, or plan with --cp 1"
        )
    return cp


def hf_request(path: Path, seq: int | None, lora_rank: int | None = None, qlora: bool = False) -> PlanRequest:
    """A Hugging Face model's config.json (or its folder), with the template's default setup, one sample of --seq
    tokens (default: the template's training.seq_len). With `lora_rank` (--lora, --qlora): the adapters a `new
    --lora` project's [lora] table adds (its defaults at that rank; a mixture-of-experts model's attention layers
    only, the targets plan models there), on an NF4 base with `qlora`: as hf_project_request plans that project."""
    try:
        model = read_hf_config(path)
        if lora_rank is not None:
            table = {"rank": lora_rank} | ({"target_modules": list(ATTENTION)} if model.moe_layers else {})
            model = replace(model, lora=read_lora(path, table, model))
    except HfConfigError as error:
        raise PlanError(str(error)) from None
    if qlora:
        model = _nf4_base(model, "--qlora:", "plan it with --lora (an unquantized base)")
    return PlanRequest(
        model=model,
        label=f"{model.model_type} {model.source}{_lora_label(model)}",
        **{name: questions()[name].default for name in ("gpus", "nodes", "precision", "tp")},
        seq_len=seq or TEMPLATE_TRAINING["seq_len"],
        grad_accum_steps=None,
        grad_sync=TEMPLATE_GRAD_SYNC,
    )


def _hf_model_folder(config: Path, model_table: object) -> Path:
    """The local folder an hf project's [model] path names (relative to the project), holding its config.json."""
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
    return local


def hf_project_request(config: Path, tp: int | None, seq: int | None, cp: int | None = None) -> PlanRequest:
    """A family hf project: the model of its [model] path's config.json (a local folder), its [lora] adapters, its
    [training] batch, its [parallel] layout (tp, cp, pp: planned from the model's declared plans), and the answers
    it was generated with."""
    raw = read_toml(config)
    model_table = raw.get("model", {})
    local = _hf_model_folder(config, model_table)
    try:
        model = read_hf_config(local)
        if "lora" in raw:
            model = replace(model, lora=read_lora(config, raw["lora"], model))
    except HfConfigError as error:
        raise PlanError(str(error)) from None
    # [model] of an hf project has no llama keys: read [training] and the answers with an empty [model].
    _, training, answers = _read_config(config, model_table={})
    if model.lora and answers.get("qlora"):  # a --qlora project: the adapted layers' frozen weights in NF4
        model = _nf4_base(model, f"{config}:", "plan the model with fsdp2gen plan --hf-config")
    lora = _lora_label(model)
    task = str(_default("task", answers))
    return PlanRequest(
        **_project_pipeline(config, answers),
        **_parallel_settings(config, answers),
        model=model,
        label=f"{config} ({model.model_type} {model.source}{lora}, task {task})",
        gpus=_default("gpus", answers),
        nodes=_default("nodes", answers),
        precision=str(_default("precision", answers)),
        tp=tp or _project_tp(config, answers),
        cp=_project_cp(config, answers, cp),
        seq_len=seq or training["seq_len"],
        global_batch_size=training["global_batch_size"],
        grad_accum_steps=training["grad_accum_steps"],
        grad_sync=training["grad_sync"],
        task=task,
        loss_chunks=training["loss_chunks"],
    )


def _nf4_base(model: HfShape, where: str, fix: str) -> HfShape:
    """`model`'s LoRA on an NF4 base (QLoRA: the adapted layers' frozen weights in NF4); `where` names the source."""
    if model.moe_layers:
        raise PlanError(
            f"{where} QLoRA on a mixture-of-experts model ({model.model_type}, {model.source}) is not modelled by plan "
            f"yet (which weights nf4.py quantizes around transformers' fused experts); {fix}"
        )
    return replace(model, lora=replace(model.lora, nf4=True))


def _lora_label(model: HfShape) -> str:
    """What the plan's first line adds for LoRA: ' + LoRA rank 16' (QLoRA on an NF4 base), '' without adapters."""
    return f" + {'QLoRA' if model.lora.nf4 else 'LoRA'} rank {model.lora.rank}" if model.lora else ""


def size_request(size: str, seq: int | None) -> PlanRequest:
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
