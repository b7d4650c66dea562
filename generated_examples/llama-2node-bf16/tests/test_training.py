"""End-to-end tests: real torchrun processes, gloo on CPU (or nccl on every visible GPU).

Run with `pytest`. Each test trains a tiny model for a few steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

PROJECT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NPROC = torch.cuda.device_count() if DEVICE == "cuda" else 2
# 1 process vs NPROC processes: equal up to float rounding, looser when computing in low precision.
PARITY_TOLERANCE = 2e-2
TINY_MODEL = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.max_seq_len", "64",
    "--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "2",
    "--job.device", DEVICE, "--job.log_every", "1",
]  # fmt: skip


def launch(script: str, output_dir: Path, *overrides: str, nproc: int = NPROC) -> subprocess.CompletedProcess:
    """Run `script` under torchrun with the tiny model; fail the test with its output if it fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [script, "--config", "config.toml", *TINY_MODEL, "--job.output_dir", str(output_dir), *overrides]
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    return result


def train(output_dir: Path, *overrides: str, nproc: int = NPROC) -> list[dict]:
    launch("train.py", output_dir, *overrides, nproc=nproc)
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_decreases_on_a_repeated_batch(tmp_path: Path) -> None:
    # synthetic_samples == global_batch_size: every step sees the same 8 samples.
    metrics = train(tmp_path, "--training.steps", "8", "--training.lr", "1e-2", "--data.synthetic_samples", "8")
    losses = [m["loss"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert losses[-1] < 0.8 * losses[0], losses
    for record in metrics:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib"} <= record.keys()
        assert record["tokens_per_s"] > 0 and record["peak_mem_mib"] > 0


def test_ranks_match_one_process(tmp_path: Path) -> None:
    # The global batch is fixed, so the number of ranks must not change the numbers.
    steps = ["--training.steps", "4", "--training.grad_accum_steps", "2"]
    single = train(tmp_path / "one", *steps, nproc=1)
    sharded = train(tmp_path / "many", *steps)
    for a, b in zip(single, sharded, strict=True):
        assert abs(a["loss"] - b["loss"]) <= PARITY_TOLERANCE * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= PARITY_TOLERANCE * max(1.0, a["grad_norm"]), (a, b)


def test_meta_init_matches_eager_init(tmp_path: Path) -> None:
    result = launch("tests/check_init.py", tmp_path)
    assert "MISMATCH" not in result.stdout
    assert result.stdout.count("tensors equal") == NPROC


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = train(tmp_path / "a", "--training.steps", "5", "--checkpoint.interval", "3")
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step-3", "step-5"]
    # A run that died after step 3: only its step-3 checkpoint (and a half-written save) survived.
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-3", tmp_path / "b" / "checkpoints" / "step-3")
    (tmp_path / "b" / "checkpoints" / "step-4.tmp").mkdir()
    resumed = train(tmp_path / "b", "--training.steps", "5", "--checkpoint.interval", "3")
    assert [m["step"] for m in resumed] == [4, 5]
    for a, b in zip(uninterrupted[3:], resumed, strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), (a, b)


def test_keep_last_deletes_older_checkpoints(tmp_path: Path) -> None:
    train(tmp_path, "--training.steps", "4", "--checkpoint.interval", "1", "--checkpoint.keep_last", "2")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-3", "step-4"]


def test_unknown_config_key_is_rejected() -> None:
    result = subprocess.run(
        [sys.executable, "train.py", "--training.stepz", "3"], cwd=PROJECT, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "unknown key training.stepz" in result.stderr
