"""The losses and gradient norms of representative projects, step by step, against those recorded in
tests/data/loss_history.json before the template's redesign (issue 17): restructuring the template must not
change what a project computes.

Each project trains 4 steps on 2 gloo ranks (fp32 unless the option needs bf16). The tolerance is relative
2e-4: below what a change of initialisation, loss scaling or mixed precision moves (bf16 compute instead of fp32
moves a grad norm by 4e-3 here, float8 by 4e-2), above the last-bit differences of another CPU's matmul kernels.
FSDP2GEN_RECORD_LOSSES=1 rewrites the file (only ever from a template known to be right).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.conftest import TINY, generate, metrics, save_tiny_llama, torchrun

HISTORY = Path(__file__).parent / "data" / "loss_history.json"
RECORD = os.environ.get("FSDP2GEN_RECORD_LOSSES") == "1"

# name: (fsdp2gen new options, train.py overrides)
PROJECTS = {
    "llama-fp32": (["--gpus", "2", "--fp32"], []),
    "llama-bf16-float8": (["--gpus", "2", "--bf16", "--float8"], []),
    "llama-fp32-tp2": (["--gpus", "2", "--fp32", "--tp", "2"], []),
    "llama-fp32-hsdp": (["--gpus", "2", "--fp32"], ["--parallel.dp_replicate", "2"]),
    "llama-fp16-full-checkpoint": (["--gpus", "2", "--precision", "fp16", "--checkpoint", "full"], []),
    "llama-bf16-offload-async": (["--gpus", "2", "--bf16", "--cpu-offload", "--checkpoint", "dcp-async"], []),
    "custom-fp32": (["--family", "custom", "--gpus", "2", "--fp32"], []),
    "hf-fp32": (["--family", "hf", "--gpus", "2", "--fp32"], []),
    "hf-fp32-lora": (["--family", "hf", "--gpus", "2", "--fp32", "--lora"], []),
}
CUSTOM_TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.vocab_size", "128",
               "--model.max_seq_len", "64", "--training.seq_len", "32", "--training.global_batch_size", "8",
               "--training.warmup_steps", "2", "--training.lr", "1e-2", "--job.log_every", "1"]  # fmt: skip
HF_TINY = ["--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "2",
           "--training.lr", "1e-2", "--job.log_every", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "model", "the quick brown fox jumps over the lazy dog " * 50)


def losses_of(name: str, root: Path, tiny_llama: Path) -> list[list[float]]:
    options, overrides = PROJECTS[name]
    family = options[options.index("--family") + 1] if "--family" in options else "llama"
    model_options = ["--hf-model", str(tiny_llama)] if family == "hf" else []
    project = generate(root / "run", *options, *model_options)
    sizes = {"llama": TINY, "custom": CUSTOM_TINY, "hf": HF_TINY}[family]
    output_dir = root / "out"
    torchrun(project, "train.py", *sizes, *overrides, "--job.device", "cpu", "--training.steps", "4",
             "--job.output_dir", str(output_dir))  # fmt: skip
    return [[record["loss"], record["grad_norm"]] for record in metrics(output_dir)]


@pytest.mark.parametrize("name", PROJECTS)
def test_losses_and_grad_norms_are_those_recorded(name: str, tmp_path: Path, tiny_llama: Path) -> None:
    got = losses_of(name, tmp_path, tiny_llama)
    assert len(got) == 4 and all(math.isfinite(value) for step in got for value in step), got
    if RECORD:
        history = json.loads(HISTORY.read_text()) if HISTORY.exists() else {}
        HISTORY.parent.mkdir(exist_ok=True)
        history |= {name: got}
        lines = [f"  {json.dumps(key)}: {json.dumps(history[key])}" for key in sorted(history)]
        HISTORY.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    expected = json.loads(HISTORY.read_text())[name]
    flat = [value for step in got for value in step]
    assert flat == pytest.approx([value for step in expected for value in step], rel=2e-4), (
        f"{name}: got {got}, recorded {expected}"
    )
