"""Checkpoints that never lose a run: exact resume, resharding, restarts, bad checkpoints, export.

Real torchrun processes, gloo on CPU (or nccl on every visible GPU), a tiny model.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from runs import DEVICE, NPROC, PROJECT, launch, metrics, train

TEN_STEPS = ["--training.steps", "10", "--checkpoint.interval", "5"]
# Another world size splits the batch differently, so sums round differently: losses (absolute) and
# optimizer moments (relative norm) after a resume on fewer ranks, and exported vs sharded model outputs.
# bf16 compute rounds each of these much more coarsely than fp32.
RESHARD_LOSS_TOLERANCE, RESHARD_STATE_TOLERANCE, EXPORT_TOLERANCE = 1e-3, 2e-2, 2e-2


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 uninterrupted steps with checkpoints at steps 5 and 10: the run the others must reproduce."""
    output_dir = tmp_path_factory.mktemp("straight")
    train(output_dir, *TEN_STEPS)
    return output_dir


def checkpoint_names(output_dir: Path) -> list[str]:
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


def load_checkpoint(folder: Path) -> dict:
    """Everything a checkpoint holds, as full tensors and plain values, read in this process."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder, Path(scratch) / "checkpoint.pt")
        return torch.load(Path(scratch) / "checkpoint.pt", weights_only=True)["train"]


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {key: value for k, v in tree.items() for key, value in flatten(v, f"{prefix}{k}.").items()}
    if isinstance(tree, list) and any(isinstance(item, dict | torch.Tensor) for item in tree):
        return {key: value for i, v in enumerate(tree) for key, value in flatten(v, f"{prefix}{i}.").items()}
    return {prefix.removesuffix("."): tree}


def assert_identical(expected: dict, actual: dict, ignore: str = "^$") -> None:
    """Same entries, bit for bit (except those whose flattened name matches `ignore`)."""
    expected = {k: v for k, v in flatten(expected).items() if not re.match(ignore, k)}
    actual = {k: v for k, v in flatten(actual).items() if not re.match(ignore, k)}
    assert expected.keys() == actual.keys()
    assert [k for k, v in expected.items() if not same(v, actual[k])] == []


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_resume_is_bit_exact_and_ignores_tmp_leftovers(straight: Path, tmp_path: Path) -> None:
    assert checkpoint_names(straight) == ["step-10", "step-5"]
    # A run that died after step 5, in the middle of a later save. Its step-7.tmp must be ignored; it is a
    # copy of a later complete checkpoint here, so that resuming from it by mistake would show.
    shutil.copytree(straight / "checkpoints" / "step-5", tmp_path / "checkpoints" / "step-5")
    shutil.copytree(straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-7.tmp")
    resumed = train(tmp_path, *TEN_STEPS)
    assert [m["step"] for m in resumed] == [6, 7, 8, 9, 10]
    for a, b in zip(metrics(straight)[5:], resumed, strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), (a, b)
    # The leftover is gone, and the last checkpoints are equal bit for bit: parameters, optimizer state,
    # scheduler, step, and every rank's RNG states (restored from step-5: a fresh process has other ones).
    assert checkpoint_names(tmp_path) == ["step-10", "step-5"]
    expected, actual = straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10"
    assert_identical(load_checkpoint(expected), load_checkpoint(actual))


@pytest.mark.skipif(DEVICE == "cuda" and NPROC < 2, reason="needs 2 GPUs")
def test_a_killed_rank_restarts_the_job_from_the_newest_checkpoint(straight: Path, tmp_path: Path) -> None:
    # Rank 1 SIGKILLs itself after step 7 (once a checkpoint exists); torchrun restarts both ranks.
    result = launch("tests/kill_rank.py", tmp_path, *TEN_STEPS, nproc=2, max_restarts=1, env={"KILL_AFTER_STEP": "7"})
    assert "rank 1: SIGKILL after step" in result.stdout, result.stdout
    assert f"resumed from {tmp_path / 'checkpoints'}/step-" in result.stdout, result.stdout
    records = metrics(tmp_path)
    assert records[-1]["loss"] == metrics(straight)[-1]["loss"]
    # One row per step: the row of step 6, logged before the kill and repeated after the resume from step 5, was
    # set aside (metrics.rewound.jsonl), not written twice and not deleted.
    assert [record["step"] for record in records] == list(range(1, 11))
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.rewound.jsonl").read_text().splitlines()] == [6]
    # Same final parameters and optimizer state (the RNG states are those of other processes).
    expected, actual = straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10"
    assert_identical(load_checkpoint(expected), load_checkpoint(actual), ignore=r"rng\.")


@pytest.mark.skipif(DEVICE == "cuda" and NPROC < 4, reason="needs 4 GPUs")
def test_resume_on_fewer_ranks_continues_the_same_run(tmp_path: Path) -> None:
    steps = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2"]
    four = train(tmp_path / "four", *steps, nproc=4)
    # keep_last 2: step-2 was deleted once step-6 was complete.
    assert checkpoint_names(tmp_path / "four") == ["step-4", "step-6"]
    reference = load_checkpoint(tmp_path / "four" / "checkpoints" / "step-6")
    for nproc in (2, 1):
        run = tmp_path / f"on-{nproc}"
        shutil.copytree(tmp_path / "four" / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
        resumed = train(run, *steps, nproc=nproc)
        assert [m["step"] for m in resumed] == [5, 6]
        for a, b in zip(four[4:], resumed, strict=True):
            assert abs(a["loss"] - b["loss"]) <= RESHARD_LOSS_TOLERANCE, (nproc, a, b)
        # The optimizer state was carried over, not created anew: Adam's step count went on from 4 to 6
        # (a fresh optimizer would count 2), and its moments match the 4-rank run's (fresh ones would be
        # off by about 100%).
        continued = load_checkpoint(run / "checkpoints" / "step-6")
        for name, expected in adam_state(reference).items():
            actual = adam_state(continued)[name]
            assert actual["step"].item() == 6, (nproc, name)
            for moment in ("exp_avg", "exp_avg_sq"):
                error = ((actual[moment] - expected[moment]).norm() / expected[moment].norm()).item()
                assert error <= RESHARD_STATE_TOLERANCE, (nproc, name, moment, error)


def adam_state(checkpoint: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's AdamW state (step, exp_avg, exp_avg_sq), by parameter name."""
    return checkpoint["optimizer"]["state"]


def test_export_loads_into_a_plain_model_with_the_same_output(straight: Path, tmp_path: Path) -> None:
    exported = tmp_path / "exported"
    export = subprocess.run(
        [sys.executable, "scripts/export.py", str(straight / "checkpoints" / "step-10"), "--output", str(exported)],
        cwd=PROJECT, capture_output=True, text=True,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    # The sharded model, loaded by train.py's checkpoint_load, on a fixed input.
    shutil.copytree(straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10")
    launch("tests/model_output.py", tmp_path, *TEN_STEPS)
    distributed = torch.load(tmp_path / "model_output.pt", weights_only=True)

    # The exported folder loads as a Hugging Face model, with its config and tokenizer.
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    # Compute as the sharded model does: parameters in bf16 (MixedPrecisionPolicy), buffers as they are.
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    model.eval()
    with torch.no_grad():
        logits = model(distributed["tokens"]).logits.float()
    torch.testing.assert_close(logits, distributed["logits"], rtol=0, atol=EXPORT_TOLERANCE)


def test_a_corrupt_checkpoint_stops_with_a_clear_error(straight: Path, tmp_path: Path) -> None:
    # The run's only checkpoint. (Were there an older one, resume would set the corrupt one aside, say so, and
    # resume from the older one.)
    shutil.copytree(straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10")
    newest = tmp_path / "checkpoints" / "step-10"
    truncated = newest / "__1_0.distcp"
    intact = truncated.read_bytes()
    truncated.write_bytes(intact[: len(intact) // 2])
    refused_with(tmp_path, newest, "(ValueError: ")
    # The same size, 64 bytes inverted: only the checksum recorded at save tells.
    truncated.write_bytes(intact[:-64] + bytes(byte ^ 0xFF for byte in intact[-64:]))
    refused_with(tmp_path, newest, f"({truncated.name}: checksum mismatch)", before_build=False)
    truncated.write_bytes(intact)
    # DCP's index of the checkpoint, missing or garbage: the same one line, not DCP's traceback.
    metadata = newest / ".metadata"
    intact = metadata.read_bytes()
    metadata.unlink()
    refused_with(tmp_path, newest, f"(FileNotFoundError: no .metadata in {newest})")
    metadata.write_bytes(b"garbage")
    refused_with(tmp_path, newest, "(ValueError: .metadata is not a DCP metadata file")
    metadata.write_bytes(intact)
    (newest / "checkpoint.json").write_text("{")
    refused_with(tmp_path, newest, "(JSONDecodeError: ")


def refused_with(output_dir: Path, newest: Path, reason: str, before_build: bool = True) -> None:
    """Resuming from `newest` stops with one line that names it, the reason and the fix, before any training (and,
    unless the ranks found it verifying checksums at the load, before the model is built)."""
    result = launch("train.py", output_dir, "--training.steps", "12", nproc=1, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"train.py: error: checkpoint {newest} cannot be loaded {reason}"), result.stderr
    assert result.stderr.endswith(
        "and no older checkpoint is left to resume from; restore it from a copy, or start a new run in another "
        "--job.output_dir\n"
    ), result.stderr
    # Never a silent fresh start: nothing was trained (or even built).
    assert not (output_dir / "metrics.jsonl").exists()
    assert "parameters" not in result.stdout or not before_build


def test_resume_refuses_a_run_it_cannot_continue(straight: Path, tmp_path: Path) -> None:
    # Another global batch size would re-read or skip samples: data.py addresses them by step x batch size.
    shutil.copytree(straight / "checkpoints" / "step-5", tmp_path / "batch" / "checkpoints" / "step-5")
    # So would another sequence length: samples are windows of seq_len + 1 tokens.
    checkpoint = tmp_path / "batch" / "checkpoints" / "step-5"
    saved = json.loads((checkpoint / "checkpoint.json").read_text())["config"]["training"]
    for key in ("global_batch_size", "seq_len"):
        changed = str(saved[key] // 2)
        result = launch("train.py", tmp_path / "batch", *TEN_STEPS, f"--training.{key}", changed, nproc=1, check=False)
        assert (result.returncode, result.stderr) == (2, (
            f"train.py: error: {checkpoint} was saved with training.{key} {saved[key]}, but this run has {changed} (a "
            f"resume may not change what defines the run); resume with --training.{key} {saved[key]}, or start a new "
            "run in another --job.output_dir\n"
        ))  # fmt: skip
    # A model-only final checkpoint has no optimizer state: it ends a run and cannot extend it.
    run = tmp_path / "model-only"
    train(run, "--training.steps", "2", "--checkpoint.interval", "1", "--checkpoint.model_only_final", "true", nproc=1)
    final = run / "checkpoints" / "step-2"
    assert load_checkpoint(final).keys() == {"model"}
    assert load_checkpoint(run / "checkpoints" / "step-1").keys() > {"model", "optimizer"}
    result = launch("train.py", run, "--training.steps", "4", nproc=1, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith(f"train.py: error: {final} is a model-only final checkpoint"), result.stderr


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_new_run_never_mixes_with_another_runs_files(keep_last: int, tmp_path: Path) -> None:
    steps = ["--checkpoint.interval", "2", "--checkpoint.keep_last", str(keep_last)]
    first = train(tmp_path, "--training.steps", "4", *steps, nproc=1)
    kept = ["step-4"] if keep_last == 1 else ["step-2", "step-4"]
    assert checkpoint_names(tmp_path) == kept
    before = {path: path.read_bytes() for path in sorted(tmp_path.rglob("*")) if path.is_file()}
    # A new run in the same folder would prune the old run's checkpoints as if they were its own, or be
    # resumed as the old run later: it is refused before anything is built, and nothing changes.
    result = launch("train.py", tmp_path, "--training.steps", "2", "--checkpoint.resume", "never", *steps, nproc=1,
                    check=False)  # fmt: skip
    assert (result.returncode, result.stderr) == (2, (
        f"train.py: error: job.output_dir {tmp_path} already holds a run (run.json; metrics.jsonl; checkpoints "
        f"{', '.join(kept)}); checkpoint.resume = 'never' starts a new run, which must not mix with it: give the "
        "new run its own --job.output_dir, or continue that run with --checkpoint.resume auto\n"
    ))  # fmt: skip
    assert {path: path.read_bytes() for path in sorted(tmp_path.rglob("*")) if path.is_file()} == before
    # In its own folder the new run gets its own id; the old run resumes as itself, and every row and
    # checkpoint says which run it belongs to.
    # (Beside it, not inside: a folder inside another run's folder is refused, that run may prune it.)
    other = train(tmp_path.with_name(f"{tmp_path.name}-other"), "--training.steps", "2", "--checkpoint.resume",
                  "never", *steps, nproc=1)  # fmt: skip
    resumed = train(tmp_path, "--training.steps", "6", *steps, nproc=1)
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    assert {row["run_id"] for row in resumed} == {run_id} != {row["run_id"] for row in other}
    assert [row["step"] for row in resumed] == [1, 2, 3, 4, 5, 6] and resumed[:4] == first
    assert checkpoint_names(tmp_path) == (["step-6"] if keep_last == 1 else ["step-4", "step-6"])
    for name in checkpoint_names(tmp_path):
        assert json.loads((tmp_path / "checkpoints" / name / "checkpoint.json").read_text())["run_id"] == run_id
