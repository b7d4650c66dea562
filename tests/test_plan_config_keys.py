"""`plan --config` plans a project as configured: every key of config.toml that changes memory is read from it
(fsdp2gen/plan_keys.py's CONFIG_KEYS), and a flag given overrides it.

The schema is walked, not listed: every generated example's config.py (its dataclasses, torch-free) names the keys a
project can have, so a key added to the template later fails here until plan_keys.py says what plan does with it.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdp2gen.plan import build_request, estimate
from fsdp2gen.plan_keys import CONFIG_KEYS, NOTED, READ
from fsdp2gen.plan_layout import PlanError
from fsdp2gen.plan_report import to_json
from tests.conftest import REPO, project_modules
from tests.helpers.plan_simulation import write_config

EXAMPLES = REPO / "generated_examples"


def schema_keys(example: Path) -> set[str]:
    """The "section.key" names of `example`'s config.py: the Config dataclass's sections and their fields."""
    with project_modules(example):
        config = importlib.import_module("config").Config()  # every section at its defaults
    sections = [spec.name for spec in dataclasses.fields(config)]
    return {f"{name}.{spec.name}" for name in sections for spec in dataclasses.fields(getattr(config, name))}


SCHEMA = {example.name: schema_keys(example) for example in sorted(EXAMPLES.iterdir())}


def test_every_key_of_every_example_is_declared() -> None:
    found = set().union(*SCHEMA.values())
    missing = sorted(found - set(CONFIG_KEYS))
    assert not missing, f"add these keys to fsdp2gen/plan_keys.py's CONFIG_KEYS (read, noted, or why not): {missing}"
    # And no stale entry: each declared key is some example's (an example per option keeps this true).
    assert sorted(set(CONFIG_KEYS) - found) == []


# A value off the example's own for each key that changes memory: planning the example with it must change the
# request (or be refused by name, as a project refuses it). A key declared READ or NOTED later needs one here.
CHANGED = {
    "training.global_batch_size": 64,
    "training.seq_len": 128,
    "training.grad_accum_steps": 2,
    "training.grad_sync": "last_micro_batch",
    "training.loss_chunks": 4,
    "data.document_mask": True,
    "parallel.dp_replicate": 2,
    "parallel.dp_shard": 3,
    "parallel.tp": 1,
    "parallel.cp": 1,
    "parallel.ep": 1,
    "parallel.pp": 1,
    "parallel.pp_schedule": "GPipe",
    "parallel.pp_stages_per_rank": 2,
    "parallel.pp_layers": [1, 3],
    "parallel.activation_checkpointing": "none",
    "parallel.activation_checkpoint_every": 3,
    "parallel.cpu_offload": False,
    "parallel.prefetch_blocks": 2,
    "parallel.reshard_after_forward": False,
    "parallel.reduce_dtype": "bfloat16",
    "parallel.output_dtype": "compute",
    "parallel.compile": False,
    "parallel.float8": False,
    "parallel.shard_modules": ["Attention"],
    "model.size": "debug-moe",
    "model.vocab_size": 1000,
    "model.dim": 512,
    "model.n_layers": 2,
    "model.n_heads": 16,
    "model.n_kv_heads": 2,
    "model.ffn_dim": 1024,
    "model.max_seq_len": 4096,
    "model.tie_embeddings": True,
    "model.n_experts": 4,
    "model.top_k": 1,
    "model.moe_ffn_dim": 256,  # debug-moe, the --moe example's size, has 128
    "model.n_shared_experts": 2,
    "model.n_dense_layers": 2,
    "model.path": "elsewhere",
    "lora.rank": 4,
    "lora.target_modules": ["q_proj"],
    "lora.dropout": 0.1,
}
MEMORY_KEYS = sorted(key for key, how in CONFIG_KEYS.items() if how in (READ, NOTED))


def example_with(key: str) -> Path:
    """An example whose schema has `key` (PREFERRED's, else the first llama one: the hf ones need a model folder; plan
    refuses the custom family)."""
    if key in PREFERRED:
        return EXAMPLES / PREFERRED[key]
    names = sorted((name for name in SCHEMA if not name.startswith("custom")), key=lambda name: name.startswith("hf"))
    return EXAMPLES / next(name for name in names if key in SCHEMA[name])


# The document mask matters (it is refused) only under context parallelism, shared experts only beside routed ones.
PREFERRED = {"data.document_mask": "llama-8gpu-bf16-cp2", "model.n_shared_experts": "llama-4gpu-bf16-moe-ep2"}


def keys_only(name: str, keys: dict) -> SimpleNamespace:
    """What write_config takes: a name and the "section.key" values to set (the example's other keys as they are)."""
    return SimpleNamespace(id=name, keys=lambda: keys)


def hf_model_folder(root: Path) -> Path:
    """A folder with a small Llama config.json (no weights: plan reads the config only)."""
    import json

    folder = root / "model"
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 2048}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("key", MEMORY_KEYS)
def test_each_memory_key_is_read_from_the_config(key: str, tmp_path: Path) -> None:
    assert key in CHANGED, f"give {key} a changed value in CHANGED"
    example = example_with(key)
    project = tmp_path / example.name
    shutil.copytree(example, project)
    extra = {"model.path": str(hf_model_folder(tmp_path))} if example.name.startswith("hf") else {}
    unchanged = write_config(project, keys_only("unchanged", extra))
    changed = write_config(project, keys_only("changed", extra | {key: CHANGED[key]}))
    if key == "model.path":  # a folder without config.json: refused by name
        (tmp_path / "elsewhere").mkdir()
    before = build_request(config=unchanged)
    try:
        after = build_request(config=changed)
    except PlanError as error:
        name = key.split(".")[1]
        assert name in str(error) or name.replace("_", "-") in str(error), (key, str(error))
        return
    differs = replace(after, label=before.label) != before
    assert differs, f"{key} = {CHANGED[key]!r} left the plan of {example.name} as it was: plan_keys.py says it is read"


def test_a_configured_project_plans_as_the_flags_would() -> None:
    """Selective AC, CPU offload and HSDP (2 copies of 2 GPUs) in config.toml: the plan is the one the flags give
    over the project's defaults, and each flag given still overrides the config."""
    project = EXAMPLES / "llama-4gpu-bf16-full-offload"
    configured_keys = {"parallel.activation_checkpointing": "selective", "parallel.cpu_offload": True,
                       "parallel.dp_replicate": 2}  # fmt: skip
    plain_keys = {
        "parallel.activation_checkpointing": "none",
        "parallel.cpu_offload": False,
        "parallel.dp_replicate": 1,
    }
    root = Path(pytest.importorskip("tempfile").mkdtemp())
    shutil.copytree(project, root / "p")
    configured = write_config(root / "p", keys_only("configured", configured_keys))
    plain = write_config(root / "p", keys_only("plain", plain_keys))
    from_config = to_json(estimate(build_request(config=configured)))
    from_flags = to_json(
        estimate(build_request(config=plain, activation_checkpointing="selective", cpu_offload=True, dp_replicate=2))
    )
    for plan in (from_config, from_flags):
        del plan["model"]["label"], plan["model"]["source"]  # the config file's name
    assert from_config == from_flags
    assert from_config["setup"]["fsdp_ranks"] == 2 and from_config["setup"]["ac"] == "selective"
    overridden = build_request(config=configured, activation_checkpointing="full", cpu_offload=False, dp_replicate=1)
    assert (overridden.ac, overridden.offload, overridden.fsdp_ranks) == ("full", False, 4)
    shutil.rmtree(root)


def test_hsdp_shards_over_one_copy_and_offers_fsdp_not_more_nodes() -> None:
    """8B on 2 nodes of 8 GPUs as a project generated for them runs it (dp_replicate 2): the state per GPU is that of 8
    shards, twice FSDP over 16's; the levers offer FSDP over all 16, and more nodes only as more copies."""
    hsdp = estimate(build_request(size="8b", gpus=8, nodes=2, dp_replicate=2, seq=8192, batch=4))
    fsdp = estimate(build_request(size="8b", gpus=8, nodes=2, seq=8192, batch=4))
    assert hsdp.per_gpu["optimizer_state"] == pytest.approx(2 * fsdp.per_gpu["optimizer_state"], rel=1e-3)
    assert 7.4 < hsdp.per_gpu["optimizer_state"] / 2**30 < 7.6
    options = [lever.option for lever in hsdp.levers]
    assert "--dp-replicate 1 (FSDP over 16 ranks instead of 8)" in options
    assert not any(option.startswith("--nodes") for option in options)  # same micro-batch: copies save nothing


def test_loss_chunks_on_the_flag_path() -> None:
    whole = estimate(build_request(size="1b", seq=8192, loss_chunks=1), with_levers=False)
    chunked = estimate(build_request(size="1b", seq=8192, loss_chunks=16), with_levers=False)
    assert (whole.request.loss_chunks, chunked.request.loss_chunks) == (1, 16)
    assert chunked.per_gpu["loss_backward"] < whole.per_gpu["loss_backward"]
    with pytest.raises(PlanError, match="^--loss-chunks 9000 exceeds the sequence length \\(8192\\); lower it$"):
        build_request(size="1b", seq=8192, loss_chunks=9000)


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"parallel.activation_checkpointing": "some"},
         "parallel.activation_checkpointing must be one of none, selective, layer, full, got 'some'"),
        ({"parallel.cpu_offload": 1}, "parallel.cpu_offload must be true or false, got 1"),
        ({"parallel.dp_replicate": 0}, "parallel.dp_replicate must be an int of at least 1, got 0"),
        ({"parallel.dp_replicate": 3},
         "dp_replicate 3 x dp_shard (the rest) x cp 1 x tp 1 does not make the 4 GPUs; change --dp-replicate or "
         "parallel.dp_replicate / dp_shard"),
    ],
)  # fmt: skip
def test_a_bad_memory_key_is_one_line_naming_it(keys: dict, message: str, tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "llama-4gpu-bf16-full-offload", tmp_path / "p")
    config = write_config(tmp_path / "p", keys_only("bad", keys))
    with pytest.raises(PlanError) as raised:
        build_request(config=config)
    assert str(raised.value).removeprefix(f"{config}: ") in (message, message + "; fix that value in the file")
