"""Checkpoints that never lose a run: exact resume, resharding, restarts, bad checkpoints, export.

Real torchrun processes, gloo on CPU (or nccl on every visible GPU), a tiny model; the refusals and the export,
which need no process of their own, run in the test's (runs.in_this_process).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from model import Model, ModelArgs
from runs import DEVICE, NPROC, in_this_process, launch, metrics, refused, train, train_several

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
    # Rank 1 SIGKILLs itself after step 7 (once a checkpoint exists); torchrun restarts both ranks. Started as a new
    # run (checkpoint.resume = "never", which refuses a folder holding another run): after the restart the folder
    # holds this same run, which resumes itself, as it would with the default "auto".
    never, kill = ["--checkpoint.resume", "never"], {"KILL_AFTER_STEP": "7"}
    result = launch("tests/kill_rank.py", tmp_path, *TEN_STEPS, *never, nproc=2, max_restarts=1, env=kill)
    assert "rank 1: SIGKILL after step 7" in result.stdout, result.stdout
    assert f"resumed from {tmp_path / 'checkpoints'}/step-5 at step 5" in result.stdout, result.stdout
    records = metrics(tmp_path)
    assert records[-1]["loss"] == metrics(straight)[-1]["loss"]
    assert {record["run_id"] for record in records} == {json.loads((tmp_path / "run.json").read_text())["run_id"]}
    # One row per step: the row of step 6, logged before the kill and repeated after the resume from step 5, was
    # set aside (metrics.rewound.jsonl), not written twice and not deleted.
    assert [record["step"] for record in records] == list(range(1, 11))
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.rewound.jsonl").read_text().splitlines()] == [6]
    # Same final parameters and optimizer state (the RNG states are those of other processes).
    expected, actual = straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10"
    assert_identical(load_checkpoint(expected), load_checkpoint(actual), ignore=r"rng\.")


# Resumed on fewer ranks: half of them (on 4 or more GPUs), and one process.
FEWER_RANKS = sorted({NPROC // 2, 1} - {0, NPROC}, reverse=True)


@pytest.mark.skipif(NPROC < 2, reason="needs 2 GPUs (NPROC >= 2)")
def test_resume_on_fewer_ranks_continues_the_same_run(straight: Path, tmp_path: Path) -> None:
    reference = load_checkpoint(straight / "checkpoints" / "step-10")
    for nproc in FEWER_RANKS:
        run = tmp_path / f"on-{nproc}"
        shutil.copytree(straight / "checkpoints" / "step-5", run / "checkpoints" / "step-5")
        resumed = train(run, *TEN_STEPS, nproc=nproc)
        assert [m["step"] for m in resumed] == [6, 7, 8, 9, 10]
        for a, b in zip(metrics(straight)[5:], resumed, strict=True):
            assert abs(a["loss"] - b["loss"]) <= RESHARD_LOSS_TOLERANCE, (nproc, a, b)
        # The optimizer state was carried over, not created anew: Adam's step count went on from 5 to 10
        # (a fresh optimizer would count 5), and its moments match those of the run on all ranks (fresh ones would
        # be off by about 100%).
        continued = load_checkpoint(run / "checkpoints" / "step-10")
        for name, expected in adam_state(reference).items():
            actual = adam_state(continued)[name]
            assert actual["step"].item() == 10, (nproc, name)
            for moment in ("exp_avg", "exp_avg_sq"):
                error = ((actual[moment] - expected[moment]).norm() / expected[moment].norm()).item()
                assert error <= RESHARD_STATE_TOLERANCE, (nproc, name, moment, error)


def adam_state(checkpoint: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's AdamW state (step, exp_avg, exp_avg_sq), by parameter name."""
    return checkpoint["optimizer"]["state"]


def test_export_loads_into_a_plain_model_with_the_same_output(straight: Path, tmp_path: Path) -> None:
    exported = tmp_path / "exported"
    # scripts/export.py is one CPU process that reads the checkpoint: run in this one (runs.in_this_process).
    export = in_this_process("scripts/export.py", str(straight / "checkpoints" / "step-10"), "--output", str(exported))
    assert export.returncode == 0, export.stderr
    # The sharded model, loaded by train.py's checkpoint_load, on a fixed input. In one process: what is compared is
    # the export, and test_resume_on_fewer_ranks_continues_the_same_run loads the NPROC ranks' checkpoint in one.
    shutil.copytree(straight / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10")
    launch("tests/model_output.py", tmp_path, *TEN_STEPS, nproc=1)
    distributed = torch.load(tmp_path / "model_output.pt", weights_only=True)

    model = Model(ModelArgs(**json.loads((exported / "config.json").read_text())))
    model.init_weights(seed=0)  # also computes the non-persistent buffers (e.g. rotary tables), which are not saved
    model.load_state_dict(load_file(exported / "model.safetensors"))
    # Compute as the sharded model does: parameters in bf16 (MixedPrecisionPolicy), buffers as they are.
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    model.eval()
    with torch.no_grad():
        logits = model(distributed["tokens"]).float()
    torch.testing.assert_close(logits, distributed["logits"], rtol=0, atol=EXPORT_TOLERANCE)


def test_a_corrupt_checkpoint_stops_with_a_clear_error(straight: Path, tmp_path: Path) -> None:
    # Damage that checkpoint.json and the files' sizes show is found before the model is built. A run whose every
    # checkpoint is damaged, each in another way: one line names each with its problem, newest first. (Were one
    # intact, resume would set the damaged newer ones aside, say so, and resume from it.)
    checkpoints = tmp_path / "damaged" / "checkpoints"
    step_10, step_9, step_8, step_7 = copies(straight / "checkpoints" / "step-10", checkpoints, 4)
    truncate(step_10 / "__1_0.distcp")
    # DCP's index of the checkpoint, missing or garbage: named, not DCP's traceback.
    (step_9 / ".metadata").unlink()
    (step_8 / ".metadata").write_bytes(b"garbage")
    (step_7 / "checkpoint.json").write_text("{")
    refused_with(tmp_path / "damaged", [
        "(ValueError: ", f"(FileNotFoundError: no .metadata in {step_9})",
        "(ValueError: .metadata is not a DCP metadata file", "(JSONDecodeError: ",
    ])  # fmt: skip
    newest, damaged = tmp_path / "flipped" / "checkpoints" / "step-10", "__1_0.distcp"
    # The same size, 64 bytes inverted: only the checksum recorded at save tells, when the ranks load it.
    shutil.copytree(straight / "checkpoints" / "step-10", newest)
    intact = (newest / damaged).read_bytes()
    (newest / damaged).write_bytes(intact[:-64] + bytes(byte ^ 0xFF for byte in intact[-64:]))
    refused_with(tmp_path / "flipped", [f"({damaged}: checksum mismatch)"], before_build=False)


def copies(checkpoint: Path, checkpoints: Path, count: int) -> list[Path]:
    """`count` copies of `checkpoint` in `checkpoints`: step-10, step-9, ... (newest first)."""
    folders = [checkpoints / f"step-{10 - i}" for i in range(count)]
    for folder in folders:
        shutil.copytree(checkpoint, folder)
    return folders


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def refused_with(output_dir: Path, reasons: list[str], before_build: bool = True) -> None:
    """Resuming stops with one line that names the newest checkpoint and the start of its problem (`reasons`, newest
    first), then each older one ("nor can step-N (problem)"), and the fix; before any training (and, unless the
    ranks found it verifying checksums at the load, before the model is built)."""
    newest, *older = sorted(
        (output_dir / "checkpoints").iterdir(), key=lambda path: int(path.name.removeprefix("step-")), reverse=True
    )
    # Found by preflight.py, before the run is locked in: in this process (runs.refused); at the load, in a process.
    if before_build:
        result = refused(output_dir, "--training.steps", "12")
    else:
        result = launch("train.py", output_dir, "--training.steps", "12", nproc=1, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    first, *nor = result.stderr.split(", nor can ")
    assert first.startswith(f"train.py: error: checkpoint {newest} cannot be loaded {reasons[0]}"), result.stderr
    for path, reason, part in zip(older, reasons[1:], nor, strict=True):
        assert part.startswith(f"{path.name} {reason}"), (path, reason, result.stderr)
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
        result = refused(tmp_path / "batch", *TEN_STEPS, f"--training.{key}", changed)
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
    result = refused(run, "--training.steps", "4")
    assert result.returncode == 2
    assert result.stderr.startswith(f"train.py: error: {final} is a model-only final checkpoint"), result.stderr


def test_a_new_run_never_mixes_with_another_runs_files(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    steps = ["--checkpoint.interval", "2", "--checkpoint.keep_last", "2"]
    # A run, and (in the same launch) a new run in a folder of its own beside it, read below.
    runs = train_several(tmp_path, {
        "run": ["--training.steps", "4", *steps],
        "other": ["--training.steps", "4", "--checkpoint.resume", "never", "--checkpoint.interval", "2",
                  "--checkpoint.keep_last", "1"],
    }, nproc=1)  # fmt: skip
    first, new = runs["run"], runs["other"]
    assert checkpoint_names(run) == ["step-2", "step-4"]
    before = {path: path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()}
    # A new run in the same folder would prune the old run's checkpoints as if they were its own, or be
    # resumed as the old run later: it is refused before anything is built, and nothing changes.
    result = refused(run, "--training.steps", "2", "--checkpoint.resume", "never", *steps)
    assert (result.returncode, result.stderr) == (2, (
        f"train.py: error: job.output_dir {run} already holds a run (run.json; metrics.jsonl; checkpoints "
        "step-2, step-4); checkpoint.resume = 'never' starts a new run, which must not mix with it: give the new run "
        "its own --job.output_dir, or continue that run with --checkpoint.resume auto\n"
    ))  # fmt: skip
    assert {path: path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()} == before
    # In its own folder the new run gets its own id, and keeps only its newest checkpoint (keep_last 1).
    # (Beside the old run, not inside: a folder inside another run's folder is refused, that run may prune it.)
    assert checkpoint_names(other) == ["step-4"]
    # The old run resumes as itself, and every row and checkpoint says which run it belongs to.
    resumed = train(run, "--training.steps", "6", *steps, nproc=1)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    assert {row["run_id"] for row in resumed} == {run_id} != {row["run_id"] for row in new}
    assert [row["step"] for row in resumed] == [1, 2, 3, 4, 5, 6] and resumed[:4] == first
    assert checkpoint_names(run) == ["step-4", "step-6"]
    for name in checkpoint_names(run):
        assert json.loads((run / "checkpoints" / name / "checkpoint.json").read_text())["run_id"] == run_id
    assert json.loads((other / "checkpoints" / "step-4" / "checkpoint.json").read_text())["run_id"] != run_id
