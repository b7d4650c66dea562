"""What a resume may change, and what happens to a checkpoint or a tokenizer that cannot be used (issue 40).

- Each config key declares in the schema whether a resume may change it: the property test (hypothesis, inside the
  project, one process) draws a key and a new value between two launches: refused in one line, or the step after
  the resume equals the uninterrupted run's; a key that defines the run is always refused with another value.
  It also draws checkpoint.json contents nobody listed: passed over like a damaged checkpoint, or one line.
- Keys a resume may change: the run continues bit for bit (logging, saving), or from the checkpoint with the new
  value in effect (the learning rate), named once.
- A newest checkpoint whose weights do not fit what its checkpoint.json claims is set aside like a corrupt one, and
  the previous one resumes; a LoRA checkpoint resumed with another lora.rank is refused before torchrun.
- A tokenizer without a vocabulary (an hf model folder whose tokenizer files are empty) is refused before
  prepare_data.py writes anything.

Launches (world size 1, the tiny model): a plain `python train.py` (the uninterrupted run), then one process for the
three resumes of the tests below (tests/helpers/several_runs.py: train.train() per run), plus the property's
in-process steps.
HYPOTHESIS_PROFILE=nightly draws more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import (
    HELPERS,
    TINY,
    generate,
    metrics,
    preflight_cases,
    project_modules,
    save_tiny_llama,
    torchrun_env,
)
from tests.helpers.scripts import captured_in_this_process
from tests.helpers.several_runs import launch_several

BASE = [*TINY, "--job.device", "cpu", "--training.steps", "4", "--checkpoint.interval", "2"]
FRESH = "start a new run in another --job.output_dir"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("resume") / "project", "--fp32")


def train(project: Path, output_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`python train.py` (one process, world size 1) with BASE."""
    return subprocess.run([sys.executable, "train.py", *BASE, "--job.output_dir", str(output_dir), *args],
                          cwd=project, env=torchrun_env(), capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def straight(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 uninterrupted steps, checkpoints at steps 2 and 4: the run the others resume and are compared to."""
    output_dir = tmp_path_factory.mktemp("straight") / "run"
    result = train(project, output_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    return output_dir


def crashed_after_step_2(straight: Path, dest: Path) -> Path:
    """The straight run as a crash before its step-4 save leaves it."""
    shutil.copytree(straight, dest)
    shutil.rmtree(dest / "checkpoints" / "step-4")
    return dest


def numbers(output_dir: Path) -> dict[int, tuple]:
    """(loss, grad norm, lr) of each step, the last row of each (a resume logs the steps after its checkpoint again)."""
    return {row["step"]: (row["loss"], row["grad_norm"], row["lr"]) for row in metrics(output_dir)}


def test_a_resume_is_refused_or_continues_the_run_for_drawn_keys_and_values(
    project: Path, straight: Path, tmp_path: Path
) -> None:
    (tmp_path / "base.json").write_text(json.dumps(BASE))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(HELPERS / "resume_property.py"), str(project), str(tmp_path / "base.json"),
         str(straight), str(tmp_path / "report.json")],
        cwd=scratch, env={**torchrun_env(), "PYTHONPATH": str(project)}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # Both sides of each property are exercised.
    print(report)
    assert report["refused_fixed"] >= 3 and report["resumed"] >= 3 and report["refused"] >= 1, report
    assert report["json_passed_over"] >= 1 and report["json_refused"] + report["json_passed_over"] >= 10, report


def test_keys_a_resume_may_change_continue_the_run_and_are_named_once(straight: Path, resumes: dict) -> None:
    expected = numbers(straight)
    # How the run logs, validates and saves: the continuation is the uninterrupted run's, bit for bit.
    run, stdout = resumes["logging"]
    assert re.findall(r"^resume: .*$", stdout, flags=re.M) == [
        "resume: this run changes job.log_every 1 -> 2, eval.every 100 -> 1, checkpoint.interval 2 -> 1 (schema.py: "
        "a resume may change them)"
    ], stdout
    assert {step: numbers(run)[step] for step in (3, 4)} == {step: expected[step] for step in (3, 4)}
    # The learning rate: the step after the checkpoint is the same (its loss and gradients come before the update),
    # and the new rate applies from it on, along the same schedule (it was 0.01; the schedule's factor stays).
    run, stdout = resumes["lr"]
    assert re.findall(r"^resume: .*$", stdout, flags=re.M) == [
        "resume: this run changes training.lr 0.01 -> 0.03 (schema.py: a resume may change them)"
    ]
    resumed = numbers(run)
    assert resumed[3][:2] == expected[3][:2]
    assert [resumed[step][2] for step in (3, 4)] == pytest.approx([3 * expected[step][2] for step in (3, 4)])
    assert resumed[4][0] != expected[4][0]  # trained with the new rate at step 3


def record(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rewrite(folder: str) -> None:
    """Rewrite the checkpoint `folder` (step-4) with one weight of another shape (the output layer's rows halved),
    through DCP's own converters, into `folder`.new: intact files that do not fit the model checkpoint.json names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    dcp_to_torch_save(folder, folder + ".pt")
    state = torch.load(folder + ".pt", weights_only=False)
    name = next(key for key in state["train"]["model"] if key.startswith("output"))
    state["train"]["model"][name] = state["train"]["model"][name][: state["train"]["model"][name].shape[0] // 2]
    torch.save(state, folder + ".pt")
    torch_save_to_dcp(folder + ".pt", folder + ".new")


def weights_that_do_not_fit(straight: Path, run: Path) -> dict[str, bytes]:
    """`run`: a copy of the straight run whose step-4 holds intact files with one weight of another shape, listed
    with their checksums in its checkpoint.json (so only the load finds the mismatch); step-4's files."""
    shutil.copytree(straight, run)
    newest = run / "checkpoints" / "step-4"
    rewrite(str(newest))
    for path in newest.iterdir():
        if path.name != "checkpoint.json":
            path.unlink()
    for path in Path(f"{newest}.new").iterdir():
        path.rename(newest / path.name)
    Path(f"{newest}.new").rmdir()
    Path(f"{newest}.pt").unlink()
    info = json.loads((newest / "checkpoint.json").read_text())
    info["files"] = {path.name: record(path) for path in sorted(newest.iterdir()) if path.name != "checkpoint.json"}
    (newest / "checkpoint.json").write_text(json.dumps(info))
    return {path.name: path.read_bytes() for path in newest.iterdir()}


@pytest.fixture(scope="module")
def resumes(project: Path, straight: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The resumes of the straight run the tests below read, in one process (several_runs.py; each run train.py's
    BASE with its own arguments): {"logging", "lr", "unfit": (its folder, its stdout)}, "stderr" (the launch's),
    "damaged" (the unfit run's step-4 files as they were before its resume)."""
    root = tmp_path_factory.mktemp("resumes")
    extra = {
        "logging": ["--job.log_every", "2", "--checkpoint.interval", "1", "--eval.every", "1"],
        "lr": ["--training.lr", "0.03"],
        "unfit": ["--training.steps", "4"],
    }
    crashed_after_step_2(straight, root / "logging")
    crashed_after_step_2(straight, root / "lr")
    damaged = weights_that_do_not_fit(straight, root / "unfit")
    runs = [[*BASE, "--job.output_dir", str(root / name), *args] for name, args in extra.items()]
    result = launch_several(project, runs, root / "runs.json", nproc=1)
    # The launch's stdout, cut at the line several_runs.py prints before each run.
    outputs = re.split(r"^run \d+: .*\n", result.stdout, flags=re.M)[1:]
    assert len(outputs) == len(extra), result.stdout[-3000:]
    found = {name: (root / name, stdout) for name, stdout in zip(extra, outputs, strict=True)}
    return {**found, "stderr": result.stderr, "damaged": damaged}


def test_weights_that_do_not_fit_the_checkpoint_json_are_set_aside_and_the_previous_checkpoint_resumes(
    straight: Path, resumes: dict
) -> None:
    (run, stdout), stderr, damaged = resumes["unfit"], resumes["stderr"], resumes["damaged"]
    newest = run / "checkpoints" / "step-4"
    # (The launch's stderr: the other two resumes say nothing there.)
    lines = re.findall(r"^.*(?:warning|error): .*$", stderr, flags=re.M)
    assert len(lines) == 1 and "rm " not in stderr, stderr[-3000:]
    assert lines[0] == (
        f"train.py: warning: checkpoint {newest} is corrupt (ValueError: Size mismatch between saved torch.Size([64, "
        "64]) and current: torch.Size([128, 64]) for train.model.output.weight); kept as step-4.corrupt, resuming from "
        "step-2"
    )
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in stdout
    # Kept as it was, beside the new step-4 of the resumed run; the steps after step 2 are the uninterrupted run's.
    aside = run / "checkpoints" / "step-4.corrupt"
    assert {path.name: path.read_bytes() for path in aside.iterdir()} == damaged
    expected = numbers(straight)
    assert {step: numbers(run)[step] for step in (3, 4)} == {step: expected[step] for step in (3, 4)}


@pytest.fixture(scope="module")
def lora_project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_llama(root / "tiny-llama", "hello world, the quick brown fox " * 50)
    return generate(root / "project", "--family", "hf", "--hf-model", str(model), "--lora", "--fp32"), model


LORA_BASE = ["--training.seq_len", "32", "--training.global_batch_size", "8", "--job.device", "cpu"]


def test_a_lora_checkpoint_resumed_with_another_rank_is_refused_before_torchrun(
    lora_project: tuple[Path, Path], tmp_path: Path
) -> None:
    project, _ = lora_project
    # A LoRA run's step-2 as train.py writes it: checkpoint.json with the run's whole config (lora.rank 16) and the
    # DCP files it records (adapters; preflight reads only their metadata and sizes). Written here, with the
    # project's config module.
    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "step-2"
    with project_modules(project), contextlib.chdir(project):
        from config import parse_args

        config = parse_args(LORA_BASE)
    with warnings.catch_warnings():  # a save in one process, without a process group: as intended here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"train": {"model": {"a": torch.zeros(16, 4)}}}, checkpoint_id=checkpoint, no_dist=True)
    info = {"step": 2, "world_size": 2, "device": "cpu", "model_only": False, "run_id": "abc",
            "config": dataclasses.asdict(config)}  # fmt: skip
    (checkpoint / "checkpoint.json").write_text(json.dumps(info))
    # preflight.py with the same rank, then another, in one process (tests/helpers/preflight_driver.py).
    head = ["--world-size", "2", *LORA_BASE, "--job.output_dir", str(out)]
    cases = {"same": [*head, "--lora.rank", "16"], "other": [*head, "--lora.rank", "8"]}
    results = preflight_cases(project, cases, tmp_path)
    assert results["same"][0] == 0 and "error: " not in results["same"][2], results["same"]
    code, stdout, stderr = results["other"]
    # (Before it, on stderr: what importing torchao and peft prints on this machine, which is not preflight's.)
    assert re.findall(r"^.*error: .*$", stderr, flags=re.M) == [
        f"preflight.py: error: {checkpoint} was saved with lora.rank 16, but this run has 8 (a resume may not change "
        f"what defines the run); resume with --lora.rank 16, or {FRESH}"
    ]
    assert (code, stdout) == (2, "") and stderr.endswith("\n")


def empty_tokenizer(folder: Path) -> None:
    """A tokenizer with no vocabulary but its end-of-text token, as save_pretrained writes it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.add_special_tokens(["<|endoftext|>"])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(folder)


@pytest.mark.parametrize("family", ["hf", "llama"])
def test_a_tokenizer_without_a_vocabulary_is_refused_before_anything_is_written(
    family: str, project: Path, lora_project: tuple[Path, Path], tmp_path: Path
) -> None:
    # An hf model folder whose tokenizer files hold no vocabulary; a llama project's tokenizer.json, the same.
    folder = tmp_path / "model"
    empty_tokenizer(folder)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 1500)  # ~68 KB
    spec = folder if family == "hf" else folder / "tokenizer.json"
    cwd = lora_project[0] if family == "hf" else project
    output = tmp_path / "tokens"
    # One process, nothing distributed: run in this one (captured_in_this_process), not a process that imports torch
    # (and, for hf, transformers) again.
    result = captured_in_this_process(cwd, "scripts/prepare_data.py", str(text), "--output", str(output),
                                      "--tokenizer", str(spec))  # fmt: skip
    assert result == (2, "", (
        f"prepare_data.py: error: the tokenizer {spec} is not usable: it has 1 token(s), and 'The quick brown fox'... "
        "becomes 0 id(s) that decode to ''; its tokenizer files are missing or empty: give data.tokenizer (or "
        "--tokenizer) a complete tokenizer\n"
    ))  # fmt: skip
    assert not output.exists()
