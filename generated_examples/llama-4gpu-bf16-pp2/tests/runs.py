"""Helpers for the tests: run the project's scripts as real processes (a refusal: in the test's own), with a tiny
model."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

from model_args import ModelArgs

PROJECT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One process per GPU, as training runs; on CPU 2 gloo ranks, or NPROC of them (NPROC=8 lays out an 8-GPU node).
NPROC = int(os.environ.get("NPROC", torch.cuda.device_count() if DEVICE == "cuda" else 2))
# Samples per step: divisible by every rank count the tests use (1, 4 and NPROC) times 2 micro-batches.
GLOBAL_BATCH = 4 * NPROC
# A model that trains in a second per step on 2 CPU ranks: these shape keys, the ones model_args.py's ModelArgs has.
TINY_SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "ffn_dim": 172,
              "max_seq_len": 64}  # fmt: skip
MODEL_KEYS = {field.name for field in dataclasses.fields(ModelArgs)}
TINY_MODEL = [
    *(item for key, value in TINY_SHAPE.items() if key in MODEL_KEYS for item in (f"--model.{key}", str(value))),
    "--training.seq_len", "32", "--training.global_batch_size", str(GLOBAL_BATCH), "--training.warmup_steps", "2",
    "--job.device", DEVICE, "--job.log_every", "1",
]  # fmt: skip

# These tests check what every project does, some of it not built for pipelines (chunked loss, document masks):
# they run without stages; fsdp2gen's tests/test_pipeline_parallel.py proves parallel.pp > 1 against one process.
TINY_MODEL += ["--parallel.pp", "1"]


def launch(
    script: str,
    output_dir: Path,
    *overrides: str,
    nproc: int = NPROC,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `script` with the tiny model under torchrun (nproc = 1: as a plain process, a group of one).

    With check, a failed run fails the test and shows its output.
    """
    if nproc == 1 and not max_restarts:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += [f"--max-restarts={max_restarts}", script]
    command += arguments(output_dir, *overrides)
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    return result


def arguments(output_dir: Path, *overrides: str) -> list[str]:
    """The command line of a script run with the tiny model in `output_dir`, then `overrides`."""
    return ["--config", "config.toml", *TINY_MODEL, "--job.output_dir", str(output_dir), *overrides]


def refused(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python train.py` with the tiny model, for a run that must stop with a usage error before it is locked in,
    built or trained, run in this process (in_this_process). Only for the mistakes preflight.py finds (the config,
    the data, the output folder and its checkpoints): they stop the run before rank 0 locks job.output_dir, a lock
    that lives as long as its process. Anything found later (a checkpoint that fails its checksums at the load) is
    launched as a process of its own."""
    return in_this_process("train.py", *arguments(output_dir, *overrides))


def in_this_process(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in the project's folder, its exit code and output as its process's would be, but run in
    THIS process (runpy): torch is imported here already, and a process of its own would import it again (seconds
    of CPU each). For scripts that train nothing and hold nothing once they exit: refusals, scripts/export.py."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved_argv = sys.argv
    with contextlib.chdir(PROJECT), torch.random.fork_rng(devices=[]):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                sys.argv = [script, *args]
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit:
                code = 0 if exit.code is None else exit.code  # sys.exit(None) exits with 0, as python does
            finally:
                sys.argv = saved_argv
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def train(output_dir: Path, *overrides: str, nproc: int = NPROC) -> list[dict]:
    launch("train.py", output_dir, *overrides, nproc=nproc)
    return metrics(output_dir)


def train_several(output_dir: Path, runs: dict[str, list[str]], *overrides: str, nproc: int = NPROC) -> dict:
    """The runs {NAME: its overrides} in ONE launch (tests/train_several.py), each with `overrides` then its own, in
    output_dir/NAME: each rank imports torch and joins the process group once, not once per run. Their metrics, by
    name."""
    launch("tests/train_several.py", output_dir, *overrides, nproc=nproc, env={"TRAIN_RUNS": json.dumps(runs)})
    return {name: metrics(output_dir / name) for name in runs}
