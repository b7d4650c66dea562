"""Parameter and optimizer-state names stay what checkpoints already hold: every golden's key lists equal the ones
recorded in tests/data/state_dict_keys/ (recorded before the blocks' container became a ModuleDict keyed by the
layer index). A renamed key would make every existing checkpoint unloadable.

To record them again after an intended change: FSDP2GEN_UPDATE_KEYS=1 pytest tests/test_state_dict_keys.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, generate, save_tiny_llama, torchrun_env
from tests.test_goldens import GOLDENS, flags

RECORDED = REPO / "tests" / "data" / "state_dict_keys"

# Run in the rendered project, on one gloo rank: the model as train.py builds it (model.py's build_model on the
# meta device), then as train.py shards and fills it (build_model_meta: float8, activation checkpointing, compile,
# fully_shard), and the keys DCP's get_state_dict saves for it and an AdamW over its trainable parameters.
PROBE = """
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh

import train
from config import load_config, parse_overrides
from model import build_model


def flat(prefix, value):
    if isinstance(value, dict):
        return [key for name, item in value.items() for key in flat(f"{prefix}.{name}" if prefix else str(name), item)]
    if isinstance(value, list):
        return [key for index, item in enumerate(value) for key in flat(f"{prefix}.{index}", item)]
    return [prefix]


config = load_config("config.toml", parse_overrides(sys.argv[1:]))
with torch.device("meta"):
    plain = build_model(config)
print("# model.state_dict() of build_model(config)")
print("\\n".join(sorted(plain.state_dict())))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
device = torch.device("cpu")
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
model = train.build_model_meta(config, mesh, device)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
model_state, optimizer_state = get_state_dict(model, optimizer)
print("# get_state_dict(model, AdamW) after build_model_meta: model")
print("\\n".join(sorted(model_state)))
print("# optimizer")
print("\\n".join(sorted(set(flat("", optimizer_state)))))
dist.barrier()
dist.destroy_process_group()
"""

# Small models of each family (two blocks: a renumbered index shows); hf: the tiny Llama the tests make.
CUSTOM_TINY = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.vocab_size", "128",
    "--model.max_seq_len", "64", "--training.seq_len", "32",
]  # fmt: skip
OVERRIDES = {"llama": TINY, "custom": CUSTOM_TINY, "hf": ["--training.seq_len", "32"]}


def key_lists(project: Path, family: str) -> str:
    if family == "hf":
        save_tiny_llama(project / "models" / "tiny-llama", "hello world, a tiny corpus " * 20)
    env = {**torchrun_env(), "PYTHONPATH": str(project)}
    command = [sys.executable, "-c", PROBE, "--job.device", "cpu", *OVERRIDES[family]]
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The headers and the keys (no key has a space), not what train.py prints (e.g. float8's count of layers).
    return "".join(line for line in result.stdout.splitlines(keepends=True) if line.startswith("#") or " " not in line)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_checkpoint_keys_equal_the_recorded_ones(tmp_path: Path, name: str) -> None:
    answers = GOLDENS[name]
    project = generate(tmp_path / name, *flags(answers))
    keys = key_lists(project, answers["family"])
    recorded = RECORDED / f"{name}.txt"
    if os.environ.get("FSDP2GEN_UPDATE_KEYS") == "1":
        recorded.parent.mkdir(parents=True, exist_ok=True)
        recorded.write_text(keys)
    assert keys.splitlines() == recorded.read_text().splitlines()
