"""Helpers for the tests: run the project's scripts as real processes (a refusal: in the test's own), with a tiny
model."""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from config import load_config

PROJECT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One process per GPU, as training runs; on CPU 2 gloo ranks, or NPROC of them (NPROC=8 lays out an 8-GPU node).
NPROC = int(os.environ.get("NPROC", torch.cuda.device_count() if DEVICE == "cuda" else 2))
# Samples per step: divisible by every rank count the tests use (1, 4 and NPROC) times 2 micro-batches.
GLOBAL_BATCH = 4 * NPROC
TINY_MODEL = [
    "--training.seq_len", "32", "--training.global_batch_size", str(GLOBAL_BATCH), "--training.warmup_steps", "2",
    "--job.device", DEVICE, "--job.log_every", "1",
]  # fmt: skip
# The tests train models of config.toml's architecture (only its config.json is read) at these sizes, with
# random weights saved by transformers.
TINY_SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 128,
}  # fmt: skip


def make_model(folder: Path, seed: int = 0, **sizes: int) -> Path:
    """Save a model of the configured architecture, with TINY_SIZES updated by `sizes`, to `folder`."""
    path = load_config(PROJECT / "config.toml").model.path
    local = PROJECT / Path(path).expanduser()
    config = AutoConfig.from_pretrained(local if local.is_dir() else path)
    for key, value in {**TINY_SIZES, **sizes}.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if layer_types := getattr(config, "layer_types", None):
        # One type per layer (e.g. sliding or full attention): the pattern, repeated over the new depth.
        config.layer_types = [layer_types[i % len(layer_types)] for i in range(config.num_hidden_layers)]
    # No dropout: its random masks differ with the number of ranks, and the tests compare runs exactly.
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    # Special tokens of the real vocabulary do not exist in the small one.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= config.vocab_size:
            setattr(config, key, None)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@functools.cache
def tiny_model() -> Path:
    """The tiny model the tests train, made once per test session."""
    folder = Path(tempfile.mkdtemp(prefix="tiny-model-"))
    atexit.register(shutil.rmtree, folder, True)
    return make_model(folder)


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
    tiny = [*TINY_MODEL, "--model.path", str(tiny_model())]
    return ["--config", "config.toml", *tiny, "--job.output_dir", str(output_dir), *overrides]


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
