"""Run-time bad input of a generated project: every mistake in the config, the data, the output folder or a
checkpoint stops with one line, exit code 2, before any model is built; the launch scripts find it before
torchrun starts (so it is neither printed per rank nor retried), and a new run never touches another run's files.

The table CASES is the list in docs/bad-inputs.md (a test keeps the two in step).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, TINY, generate, torchrun_env
from tests.helpers import several_runs
from tests.helpers.in_process import preflight_cases_in_this_process
from tests.helpers.scripts import captured_in_this_process

# id -> (preflight.py arguments, the one line it must print after "preflight.py: error: "). In the
# arguments and the line, {out} is the case's own output folder, {tmp} the folder of the shared inputs.
KNOWN_TRAINING_KEYS = (
    "steps, seed, global_batch_size, seq_len, lr, lr_min_ratio, warmup_steps, weight_decay, grad_accum_steps, "
    "grad_sync, max_norm, loss_chunks"
)
FRESH = "another --job.output_dir"
# The run's only checkpoint (corrupt() deletes the older one, which resume would use instead).
CORRUPT = f"and no older checkpoint is left to resume from; restore it from a copy, or start a new run in {FRESH}"
CASES: dict[str, tuple[list[str], str]] = {
    # The config file and the command line.
    "unknown-key": (["--training.stepz", "5"], f"unknown key training.stepz; known: {KNOWN_TRAINING_KEYS}"),
    "unknown-section": (
        ["--trainer.steps", "5"],
        "unknown option --trainer.steps; options look like --training.steps 20",
    ),
    "stray-argument": (["stray"], "unexpected argument 'stray'; overrides look like --training.steps 20"),
    "override-without-value": (["--training.steps"], "--training.steps needs a value"),
    "wrong-type": (["--training.steps", "five"], "training.steps must be int, got 'five'"),
    "wrong-choice": (["--job.device", "tpu"], "job.device must be one of 'auto', 'cpu', 'cuda', got 'tpu'"),
    "config-missing": (["--config", "{tmp}/nope.toml"], "config file {tmp}/nope.toml not found; pass --config PATH"),
    "config-not-toml": (
        ["--config", "{tmp}/broken.toml"],
        "config file {tmp}/broken.toml is not valid TOML (Expected ']' at the end of a table declaration (at line 1, "
        "column 10)); fix it, or pass --config PATH",
    ),
    # The shape of the file: a table of [sections], each a table of keys, in UTF-8 text, one level deep.
    "config-section-not-a-table": (
        ["--config", "{tmp}/section.toml"],
        "[training] in config file {tmp}/section.toml is not a table but 5; write it as a [training] line and key = "
        "value lines",
    ),
    "config-binary": (
        ["--config", "{tmp}/binary.toml"],
        "config file {tmp}/binary.toml is not text (byte 2 is not UTF-8); pass --config PATH of a TOML file",
    ),
    "config-nested-100000-deep": (
        ["--config", "{tmp}/deep.toml"],
        "config file {tmp}/deep.toml nests arrays or tables too deeply to read; a config has one level of [sections]",
    ),
    "config-value-a-table": (
        ["--config", "{tmp}/value-table.toml"],
        "training.steps must be int, got {{'a': 1}}",
    ),
    "config-is-a-folder": (
        ["--config", "{tmp}"],
        "config file {tmp} is a folder; pass --config PATH of a TOML file",
    ),
    "steps-0": (["--training.steps", "0"], "training.steps must be at least 1, got 0; e.g. --training.steps 1000"),
    "steps-negative": (
        ["--training.steps", "-3"],
        "training.steps must be at least 1, got -3; e.g. --training.steps 1000",
    ),
    "lr-nan": (["--training.lr", "nan"], "training.lr must be a positive number, got nan; e.g. --training.lr 0.0003"),
    "lr-inf": (["--training.lr", "inf"], "training.lr must be a finite number, got inf; e.g. --training.lr 0.0003"),
    "lr-0": (["--training.lr", "0"], "training.lr must be a positive number, got 0.0; e.g. --training.lr 0.0003"),
    "grad-accum-0": (
        ["--training.grad_accum_steps", "0"],
        "training.grad_accum_steps must be at least 1, got 0; e.g. --training.grad_accum_steps 1",
    ),
    "global-batch-0": (
        ["--training.global_batch_size", "0"],
        ("training.global_batch_size must be at least 1, got 0; e.g. --training.global_batch_size 32"),
    ),
    "seq-len-0": (
        ["--training.seq_len", "0"],
        "training.seq_len must be at least 1, got 0; e.g. --training.seq_len 256",
    ),
    "warmup-negative": (
        ["--training.warmup_steps", "-1"],
        "training.warmup_steps must be 0 or more, got -1; e.g. --training.warmup_steps 100",
    ),
    "lr-min-ratio-2": (
        ["--training.lr_min_ratio", "2"],
        ("training.lr_min_ratio must be between 0 and 1, got 2.0; e.g. --training.lr_min_ratio 0.1"),
    ),
    "weight-decay-negative": (
        ["--training.weight_decay", "-0.1"],
        ("training.weight_decay must be 0 or more, got -0.1; e.g. --training.weight_decay 0.1"),
    ),
    "max-norm-nan": (
        ["--training.max_norm", "nan"],
        ("training.max_norm must be 0 (no clipping) or more, got nan; e.g. --training.max_norm 1"),
    ),
    "seed-negative": (["--training.seed", "-1"], "training.seed must be 0 or more, got -1; e.g. --training.seed 0"),
    "log-every-0": (["--job.log_every", "0"], "job.log_every must be at least 1, got 0; e.g. --job.log_every 10"),
    "output-dir-empty": (
        ["--job.output_dir", ""],
        "job.output_dir is empty; name a folder, e.g. --job.output_dir outputs",
    ),
    "checkpoint-interval-0": (
        ["--checkpoint.interval", "0"],
        "checkpoint.interval must be at least 1, got 0; e.g. --checkpoint.interval 100",
    ),
    "keep-last-0": (
        ["--checkpoint.keep_last", "0"],
        "checkpoint.keep_last must be at least 1, got 0; e.g. --checkpoint.keep_last 2",
    ),
    "synthetic-samples-0": (
        ["--data.synthetic_samples", "0"],
        ("data.synthetic_samples must be at least 1, got 0; e.g. --data.synthetic_samples 4096"),
    ),
    "dp-replicate-0": (
        ["--parallel.dp_replicate", "0"],
        "parallel.dp_replicate must be at least 1, got 0; e.g. --parallel.dp_replicate 1",
    ),
    "reshard-0": (
        ["--parallel.reshard_after_forward", "0"],
        "parallel.reshard_after_forward must be true, false or at least 1, got 0; e.g. "
        "--parallel.reshard_after_forward true",
    ),
    "loss-chunks-not-dividing-seq-len": (
        ["--training.loss_chunks", "5"],
        "training.loss_chunks = 5 does not divide training.seq_len = 32 (the loss is computed in equal sequence "
        "chunks); pick a divisor of seq_len, e.g. --training.loss_chunks 1",
    ),
    "heads-not-dividing-dim": (
        ["--model.n_heads", "5"],
        "model.dim (64) must be divisible by model.n_heads (5); change one of them",
    ),
    # The layout: the numbers must fit the ranks (2 here, 8 where the case says --world-size 8).
    "batch-not-divisible": (
        ["--training.global_batch_size", "9"],
        "training.global_batch_size (9) must be divisible by data-parallel ranks x grad_accum_steps (2 x 1); "
        "e.g. --training.global_batch_size 8",
    ),
    "accumulation-not-divisible": (
        ["--training.grad_accum_steps", "3"],
        "training.global_batch_size (8) must be divisible by data-parallel ranks x grad_accum_steps (2 x 3); "
        "e.g. --training.global_batch_size 6",
    ),
    "seq-len-above-max": (
        ["--training.seq_len", "128"],
        "training.seq_len (128) exceeds model.max_seq_len (64); use --training.seq_len 64 or less",
    ),
    "replicas-not-dividing-ranks": (
        ["--parallel.dp_replicate", "3"],
        # The project has no tp: the message names only the dimensions its config has.
        "parallel.dp_replicate x dp_shard = 3 x -1 does not match the 2 ranks; choose dp_replicate that divides 2 "
        "(dp_shard = -1 takes the rest)",
    ),
    "reshard-not-dividing-shard": (
        ["--world-size", "8", "--parallel.reshard_after_forward", "3"],
        "parallel.reshard_after_forward = 3 must divide the 8 ranks each parameter is sharded over; use true, false "
        "or a divisor (e.g. the GPUs per node)",
    ),
    "world-size-0": (
        ["--world-size", "0"],
        "the first arguments must be --world-size N (the run's ranks, at least 1), got --world-size 0",
    ),
    # preflight.py's own option comes first; among the run's arguments it is train.py's to refuse, and refused here
    # as train.py would (one parser), not taken as the world size of a run whose ranks then refuse it.
    "world-size-among-run-arguments": (
        ["--training.steps", "5", "--world-size", "4"],
        "--world-size is torchrun's option, not train.py's; the launch scripts take the ranks per node from NPROC "
        "(and NNODES), e.g. NPROC=4 scripts/launch_local.sh",
    ),
    # data.path.
    "data-missing": (
        ["--data.path", "{tmp}/missing.bin"],
        "data.path {tmp}/missing.bin does not exist; point --data.path at a folder written by "
        "scripts/prepare_data.py or a flat file of token ids, or set --data.path '' for synthetic tokens",
    ),
    "data-is-a-folder": (
        ["--data.path", "{tmp}"],
        "data.path {tmp} is a folder without index.json; give a folder written by scripts/prepare_data.py (or a "
        "flat token file)",
    ),
    "data-empty": (
        ["--data.path", "{tmp}/empty.bin"],
        "data.path {tmp}/empty.bin holds 0 tokens, fewer than training.seq_len + 1 = 33; give it more data or a "
        "shorter --training.seq_len",
    ),
    "data-odd-bytes": (
        ["--data.path", "{tmp}/odd.bin"],
        "data.path {tmp}/odd.bin has 3 bytes, not a whole number of uint16 token ids (2 bytes each for "
        "model.vocab_size 128); it was written for another vocabulary or is truncated",
    ),
    "data-too-small": (
        ["--data.path", "{tmp}/small.bin"],
        "data.path {tmp}/small.bin holds 10 tokens, fewer than training.seq_len + 1 = 33; give it more data or a "
        "shorter --training.seq_len",
    ),
    "data-id-above-vocab-after-1M-tokens": (
        ["--data.path", "{tmp}/far.bin"],
        "data.path {tmp}/far.bin holds token id 500 >= model.vocab_size 128 (first at token 2500000); tokenize it "
        "with the model's tokenizer",
    ),
    "data-flat-file-with-validation": (
        ["--data.path", "{tmp}/tokens.bin"],
        "data.path {tmp}/tokens.bin is a flat token file, which has no validation split; prepare a folder with "
        "scripts/prepare_data.py, or set --eval.every 0",
    ),
    # A folder written by scripts/prepare_data.py (tests/test_real_data.py runs the script itself).
    "data-prepared-unfinished": (
        ["--data.path", "{tmp}/unfinished"],
        "data.path {tmp}/unfinished is not finished: scripts/prepare_data.py stopped before the end; run it again "
        "with the same arguments to finish it",
    ),
    "data-prepared-for-another-vocabulary": (
        ["--data.path", "{tmp}/big-vocabulary"],
        "data.path {tmp}/big-vocabulary was tokenized with a vocabulary of 50257 tokens (gpt2), but "
        "model.vocab_size is 128; prepare the data with the model's tokenizer",
    ),
    "data-prepared-shard-odd-bytes": (
        ["--data.path", "{tmp}/odd-shard"],
        "data.path {tmp}/odd-shard: shard train-00001.bin has 3 bytes, but index.json says 600 uint16 token ids "
        "(1200 bytes); it is truncated or was replaced; prepare it again with scripts/prepare_data.py --output "
        "{tmp}/odd-shard-new and point --data.path there",
    ),
    "data-prepared-shard-missing": (
        ["--data.path", "{tmp}/missing-shard"],
        "data.path {tmp}/missing-shard: shard val-00000.bin is missing; prepare it again with "
        "scripts/prepare_data.py --output {tmp}/missing-shard-new and point --data.path there",
    ),
    "data-prepared-too-few-validation-samples": (
        ["--data.path", "{tmp}/prepared", "--eval.batches", "3"],
        "data.path {tmp}/prepared has 18 validation samples of training.seq_len + 1 tokens, fewer than "
        "eval.batches x training.global_batch_size = 24; lower --eval.batches, prepare with a larger "
        "--val-fraction, or set --eval.every 0",
    ),
    "eval-every-negative": (
        ["--eval.every", "-1"],
        "eval.every must be 0 (off) or more, got -1; e.g. --eval.every 100",
    ),
    "eval-batches-0": (["--eval.batches", "0"], "eval.batches must be at least 1, got 0; e.g. --eval.batches 4"),
    "profile-memory-snapshot-on-cpu": (
        ["--profile.memory_snapshot_step", "1"],
        "profile.memory_snapshot_step records CUDA allocations, but this run has no CUDA device; set "
        "--profile.memory_snapshot_step 0",
    ),
    "profile-after-last-step": (
        ["--profile.start", "9", "--training.steps", "4"],
        "profile.start 9 is after the last step (training.steps 4); choose a step of this run, or 0 for off",
    ),
    # job.output_dir.
    "output-dir-is-a-file": (
        ["--job.output_dir", "{tmp}/odd.bin"],
        "job.output_dir {tmp}/odd.bin is a file, not a folder; choose a folder with --job.output_dir",
    ),
    "output-dir-not-creatable": (
        ["--job.output_dir", "/proc/fsdp2gen-outputs"],
        "job.output_dir /proc/fsdp2gen-outputs cannot be written (No such file or directory); choose a writable "
        "folder with --job.output_dir",
    ),
    "output-dir-under-a-file": (
        ["--job.output_dir", "{tmp}/odd.bin/outputs"],
        "job.output_dir {tmp}/odd.bin/outputs cannot be written (Not a directory); choose a writable folder with "
        "--job.output_dir",
    ),
    "new-run-in-a-folder-with-a-run": (
        ["--checkpoint.resume", "never"],
        "job.output_dir {out} already holds a run (run.json; metrics.jsonl; checkpoints step-1, step-2); "
        "checkpoint.resume = 'never' starts a new run, which must not mix with it: give the new run its own "
        "--job.output_dir, or continue that run with --checkpoint.resume auto",
    ),
    # Resuming from the newest checkpoint in job.output_dir (a finished 2-step run, unless the case changes it).
    "resume-other-model": (
        ["--model.dim", "128"],
        "{out}/checkpoints/step-2 holds a different model (model.dim 64 -> 128); resume with the model settings in "
        f"{{out}}/checkpoints/step-2/checkpoint.json, or start a new run in {FRESH}",
    ),
    "resume-other-global-batch": (
        ["--training.global_batch_size", "16"],
        "{out}/checkpoints/step-2 was saved with training.global_batch_size 8, but this run has 16 (a resume may not "
        f"change what defines the run); resume with --training.global_batch_size 8, or start a new run in {FRESH}",
    ),
    "resume-other-seq-len": (
        ["--training.seq_len", "16"],
        "{out}/checkpoints/step-2 was saved with training.seq_len 32, but this run has 16 (a resume may not change "
        f"what defines the run); resume with --training.seq_len 32, or start a new run in {FRESH}",
    ),
    # Every key the schema does not declare resume=True defines the run: the data's order, the precision...
    "resume-other-seed": (
        ["--training.seed", "1"],
        "{out}/checkpoints/step-2 was saved with training.seed 0, but this run has 1 (a resume may not change what "
        f"defines the run); resume with --training.seed 0, or start a new run in {FRESH}",
    ),
    "resume-other-synthetic-data": (
        ["--data.synthetic_samples", "100"],
        "{out}/checkpoints/step-2 was saved with data.synthetic_samples 4096, but this run has 100 (a resume may not "
        f"change what defines the run); resume with --data.synthetic_samples 4096, or start a new run in {FRESH}",
    ),
    "resume-without-document-mask": (
        ["--data.document_mask", "false"],
        "{out}/checkpoints/step-2 was saved with data.document_mask true, but this run has false (a resume may not "
        f"change what defines the run); resume with --data.document_mask true, or start a new run in {FRESH}",
    ),
    "resume-run-without-checkpoint-other-seed": (
        ["--training.seed", "1"],
        "{out} holds run {run_id} (run.json), which has no checkpoint yet and was saved with training.seed 0, but "
        "this run has 1 (a resume may not change what defines the run); resume with --training.seed 0, or start a "
        f"new run in {FRESH}",
    ),
    "resume-model-only-final": (
        [],
        "{out}/checkpoints/step-2 is a model-only final checkpoint (checkpoint.model_only_final) of a run that ended "
        "at step 2: it cannot continue training to step 4; export it with scripts/export.py, or start a new run in "
        f"{FRESH} (to continue from an earlier checkpoint, move step-2 out of {{out}}/checkpoints)",
    ),
    "checkpoint-metadata-missing": (
        [],
        "checkpoint {out}/checkpoints/step-2 cannot be loaded (FileNotFoundError: no .metadata in "
        f"{{out}}/checkpoints/step-2), {CORRUPT}",
    ),
    "checkpoint-metadata-garbage": (
        [],
        "checkpoint {out}/checkpoints/step-2 cannot be loaded (ValueError: .metadata is not a DCP metadata file "
        f"(UnpicklingError: pickle data was truncated)), {CORRUPT}",
    ),
    "checkpoint-shard-truncated": (
        [],
        "checkpoint {out}/checkpoints/step-2 cannot be loaded (ValueError: __0_0.distcp has 100 bytes, .metadata "
        f"expects at least {{shard_size}}), {CORRUPT}",
    ),
    "checkpoint-json-garbage": (
        [],
        "checkpoint {out}/checkpoints/step-2 cannot be loaded (JSONDecodeError: Expecting value: line 1 column 1 "
        f"(char 0)), {CORRUPT}",
    ),
    # checkpoint.json read through the config's schema: a field of the wrong shape is a damaged checkpoint.
    "checkpoint-json-config-not-a-table": (
        [],
        'checkpoint {out}/checkpoints/step-2 cannot be loaded (ConfigError: checkpoint.json\'s "config" is not a '
        f"table of [sections] but 5), {CORRUPT}",
    ),
    "checkpoint-json-section-missing": (
        [],
        'checkpoint {out}/checkpoints/step-2 cannot be loaded (ConfigError: checkpoint.json\'s "config" lacks the '
        f"section(s) training), {CORRUPT}",
    ),
    "checkpoint-json-key-of-another-type": (
        [],
        "checkpoint {out}/checkpoints/step-2 cannot be loaded (ConfigError: training.seq_len must be int, got [32]), "
        f"{CORRUPT}",
    ),
    "checkpoint-json-step-not-a-number": (
        [],
        "checkpoint {out}/checkpoints/step-2 cannot be loaded (ValueError: checkpoint.json: step is not int of at "
        f"least 0 but 'two'), {CORRUPT}",
    ),
    "checkpoint-of-another-run": (
        [],
        "{out}/checkpoints/step-2 belongs to run someone-else, but {out} holds run {run_id} (run.json); move the "
        f"checkpoint to its own run's folder, or start a new run in {FRESH}",
    ),
    "run-json-garbage": (
        [],
        "{out}/run.json cannot be read (JSONDecodeError: Expecting value: line 1 column 1 (char 0)); restore it, or "
        f"start a new run in {FRESH}",
    ),
}


def corrupt(case: str, out: Path) -> None:
    """Turn the copy `out` of a finished 2-step run into the broken run folder of `case`."""
    newest = out / "checkpoints" / "step-2"
    if case.startswith("checkpoint-") and case != "checkpoint-of-another-run":
        # Only the newest checkpoint is left: resume would pass over a corrupt one for an older one.
        shutil.rmtree(out / "checkpoints" / "step-1")
    if case == "checkpoint-metadata-missing":
        (newest / ".metadata").unlink()
    elif case == "checkpoint-metadata-garbage":
        (newest / ".metadata").write_text("garbage")
    elif case == "checkpoint-shard-truncated":
        shard = newest / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "checkpoint-json-garbage":
        (newest / "checkpoint.json").write_text("")
    elif case.startswith("checkpoint-json-") and case != "checkpoint-json-garbage":
        info = json.loads((newest / "checkpoint.json").read_text())
        if case == "checkpoint-json-config-not-a-table":
            info["config"] = 5
        elif case == "checkpoint-json-section-missing":
            del info["config"]["training"]
        elif case == "checkpoint-json-key-of-another-type":
            info["config"]["training"]["seq_len"] = [32]
        else:
            info["step"] = "two"
        (newest / "checkpoint.json").write_text(json.dumps(info))
    elif case == "resume-run-without-checkpoint-other-seed":
        shutil.rmtree(out / "checkpoints")
    elif case == "checkpoint-of-another-run":
        info = json.loads((newest / "checkpoint.json").read_text())
        (newest / "checkpoint.json").write_text(json.dumps({**info, "run_id": "someone-else"}))
    elif case == "run-json-garbage":
        (out / "run.json").write_text("")


def write_prepared(folder: Path, complete: bool = True, vocab_size: int = 100, tokenizer: str = "tok.json") -> None:
    """A folder as scripts/prepare_data.py writes it: train shards of 1000 and 600 tokens, a val shard of 600
    (18 samples of 33 tokens)."""
    folder.mkdir()
    shards = {"train": [("train-00000.bin", 1000), ("train-00001.bin", 600)], "val": [("val-00000.bin", 600)]}
    index = {"format": "fsdp2gen-tokens/1", "tokenizer": tokenizer, "vocab_size": vocab_size, "eos_id": 0,
             "dtype": "uint16", "complete": complete, "pieces_done": 3, "documents": True}  # fmt: skip
    for split, files in shards.items():
        index[split] = [{"file": name, "tokens": tokens, "max_id": 99, "docs_file": name.replace(".bin", ".docs")}
                        for name, tokens in files]  # fmt: skip
        for name, tokens in files:
            (np.arange(tokens) % 100).astype(np.uint16).tofile(folder / name)
            np.arange(0, tokens, 100, dtype=np.int64).tofile(folder / name.replace(".bin", ".docs"))  # documents
    (folder / "index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def inputs(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fp32 project, the broken files the cases point at, and two finished 2-step runs to resume."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    (tmp / "broken.toml").write_text("[training\nsteps = 1\n")
    (tmp / "section.toml").write_text("training = 5\n")
    (tmp / "binary.toml").write_bytes(b"[j\xff\xfe\x00\x01")
    (tmp / "deep.toml").write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp / "value-table.toml").write_text("[training]\nsteps = {a = 1}\n")
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "odd.bin").write_bytes(b"abc")
    np.arange(10, dtype=np.uint16).tofile(tmp / "small.bin")
    # Only the first 1M tokens used to be checked: the bad id sits far beyond them.
    far = np.zeros(3_000_000, dtype=np.uint16)
    far[2_500_000] = 500
    far.tofile(tmp / "far.bin")
    (np.arange(1000) % 100).astype(np.uint16).tofile(tmp / "tokens.bin")
    write_prepared(tmp / "prepared")
    write_prepared(tmp / "unfinished", complete=False)
    write_prepared(tmp / "big-vocabulary", vocab_size=50257, tokenizer="gpt2")
    write_prepared(tmp / "odd-shard")
    (tmp / "odd-shard" / "train-00001.bin").write_bytes(b"abc")
    write_prepared(tmp / "missing-shard")
    (tmp / "missing-shard" / "val-00000.bin").unlink()
    project = projects["fp32"]
    finished, model_only = tmp / "finished", tmp / "model-only"
    # Both in this process (tests/helpers/several_runs.py: train.train() per run, as `python train.py` makes each,
    # a group of one; captured_in_this_process: the test's process imported torch already).
    head = [*TINY, "--job.device", "cpu", "--training.steps", "2", "--checkpoint.interval", "1", "--job.output_dir"]
    runs = [[*head, str(finished)], [*head, str(model_only), "--checkpoint.model_only_final", "true"]]
    runs_file = tmp_path_factory.mktemp("bad-input-runs") / "runs.json"
    runs_file.write_text(json.dumps(runs))
    code, _, stderr = captured_in_this_process(project, several_runs.__file__, str(runs_file))
    assert code == 0, stderr[-3000:]
    return {"project": project, "tmp": tmp, "finished": finished, "model_only": model_only}


@pytest.fixture(scope="module")
def results(inputs: dict) -> dict[str, list]:
    """Every case of CASES, run by the project's own preflight.py (all in this process: preflight_driver.py's
    run_case, by preflight_cases_in_this_process)."""
    tmp, argvs = inputs["tmp"], {}
    for case, (args, _) in CASES.items():
        out = tmp / "out" / case
        if case.startswith(("resume-", "checkpoint-", "run-json", "new-run")):
            shutil.copytree(inputs["model_only" if case == "resume-model-only-final" else "finished"], out)
            corrupt(case, out)
        # preflight.py's own --world-size (2 unless the case starts with its own) first, then train.py's arguments.
        world, args = (args[:2], args[2:]) if args[:1] == ["--world-size"] else (["--world-size", "2"], args)
        extra = ["--training.steps", "4"] if case == "resume-model-only-final" else []
        argv = [*world, *TINY, "--job.device", "cpu", "--job.output_dir", str(out), *extra, *args]
        argvs[case] = [arg.format(out=out, tmp=tmp) for arg in argv]
    return preflight_cases_in_this_process(inputs["project"], argvs)


@pytest.mark.parametrize("case", CASES)
def test_each_mistake_is_one_line_and_exit_code_2(case: str, inputs: dict, results: dict[str, list]) -> None:
    tmp, out = inputs["tmp"], inputs["tmp"] / "out" / case
    run_id = json.loads((inputs["finished"] / "run.json").read_text())["run_id"]
    shard = inputs["finished"] / "checkpoints" / "step-2" / "__0_0.distcp"
    expected = CASES[case][1].format(out=out, tmp=tmp, run_id=run_id, shard_size=shard.stat().st_size)
    assert results[case] == [2, "", f"preflight.py: error: {expected}\n"]


def test_a_model_only_final_checkpoint_holds_the_model_alone(inputs: dict, tmp_path: Path) -> None:
    # What resume-model-only-final refuses: the run's last checkpoint (checkpoint.model_only_final) holds the model
    # and nothing else, the one before it the whole training state. (Moved here from the fp32 project's own
    # test_resume_refuses_a_run_it_cannot_continue, whose refusals are CASES' resume-other-global-batch,
    # resume-other-seq-len and resume-model-only-final: the same lines, by the same preflight.py, on the same project.)
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    held = {}
    for step in (1, 2):
        dcp_to_torch_save(inputs["model_only"] / "checkpoints" / f"step-{step}", tmp_path / f"step-{step}.pt")
        held[step] = torch.load(tmp_path / f"step-{step}.pt", weights_only=True)["train"].keys()
    assert held[2] == {"model"}
    assert held[1] > {"model", "optimizer"}


# Through the real scripts/launch_local.sh: what the script does with preflight.py's refusal (stop, exit code 2,
# nothing else) is the same for every case, whose line test_each_mistake_is_one_line_and_exit_code_2 checks; these
# two are about the launch itself (torchrun's option among the run's, a new launch inside a requeued SLURM job).
LAUNCHER_CASES = [
    "new-run-in-a-folder-with-a-run",
    "world-size-among-run-arguments",
]


@pytest.mark.parametrize("case", LAUNCHER_CASES)
def test_launch_script_stops_before_torchrun_starts(case: str, inputs: dict, tmp_path: Path) -> None:
    tmp, out = inputs["tmp"], tmp_path / "out"
    if case == "new-run-in-a-folder-with-a-run":
        shutil.copytree(inputs["finished"], out)
    before = sorted(out.rglob("*")) if out.exists() else []
    args = [arg.format(out=out, tmp=tmp) for arg in CASES[case][0]]
    # SLURM_RESTART_COUNT, as a shell inside a requeued SLURM job has it: a new launch there is still a new run (the
    # case new-run-in-a-folder-with-a-run is refused, not taken for a restart of the run in the folder).
    env = {**torchrun_env(), "NPROC": "2", "DEVICE": "cpu", "MAX_RESTARTS": "1", "SLURM_RESTART_COUNT": "1"}
    result = subprocess.run(
        ["scripts/launch_local.sh", *TINY, "--job.output_dir", str(out), *args],
        cwd=inputs["project"], env=env, capture_output=True, text=True,
    )  # fmt: skip
    expected = CASES[case][1].format(out=out, tmp=tmp)
    # One line from one process, and nothing else: torchrun (which would print its own lines, and retry) never ran.
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"preflight.py: error: {expected}\n")
    assert (sorted(out.rglob("*")) if out.exists() else []) == before


def test_multinode_launcher_checks_the_world_of_all_nodes(tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--nodes", "2", "--gpus", "2", "--fp32")
    env = {**torchrun_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "NODE_RANK": "0", "DEVICE": "cpu"}
    result = subprocess.run(
        ["scripts/launch_multinode.sh", *TINY, "--training.global_batch_size", "6", "--job.output_dir",
         str(tmp_path / "out")],
        cwd=project, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (2, "", (
        "preflight.py: error: training.global_batch_size (6) must be divisible by data-parallel ranks x "
        "grad_accum_steps (4 x 1); e.g. --training.global_batch_size 4\n"
    ))  # fmt: skip
    # Its variables: a node rank beyond the nodes, a port out of range, nodes not a number (issue 40): one line from
    # the script itself, before preflight.py or torchrun start.
    for variable, value, rule, example in [
        ("NODE_RANK", "2", "a whole number from 0 to 1", "0"),
        ("MASTER_PORT", "65536", "a whole number from 1 to 65535", "29500"),
        ("NNODES", "two", "a whole number from 1 to 100000", "2"),
    ]:
        result = subprocess.run(
            ["scripts/launch_multinode.sh", "--job.output_dir", str(tmp_path / "out-vars")],
            cwd=project, env={**env, variable: value}, capture_output=True, text=True,
        )  # fmt: skip
        expected = f"launch_multinode.sh: error: {variable} must be {rule}, got '{value}'; e.g. {variable}={example}\n"
        assert (result.returncode, result.stdout, result.stderr) == (2, "", expected)
    assert not (tmp_path / "out-vars").exists()


@pytest.mark.parametrize("case", ["unknown-key", "data-missing"])
def test_torchrun_without_the_launcher_prints_the_error_once(case: str, inputs: dict, tmp_path: Path) -> None:
    # Started without the launch script, train.py still finds the mistake before building the model, and only
    # rank 0 reports it (config errors while parsing, the rest in train.py's own preflight on rank 0). One case of
    # each of the two ways: every other case is found by the same parser (config.parse_args, every rank) or the
    # same checks (preflight.preflight, rank 0) as preflight.py's, which the cases above run, and
    # tests/test_launch_scripts.py proves that train.py's start and preflight.py give the same outcome.
    args = [arg.format(out=tmp_path, tmp=inputs["tmp"]) for arg in CASES[case][0]]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py", *TINY,
         "--job.device", "cpu", "--job.output_dir", str(tmp_path), *args],
        cwd=inputs["project"], env=torchrun_env(), capture_output=True, text=True,
    )  # fmt: skip
    expected = CASES[case][1].format(out=tmp_path, tmp=inputs["tmp"])
    assert result.returncode != 0
    assert re.findall(r"^train\.py: error: .*$", result.stderr, flags=re.M) == [f"train.py: error: {expected}"]
    assert "exitcode  : 2" in result.stderr  # torchrun's summary: the worker's exit code
    assert "parameters" not in result.stdout  # train.py prints the model's size once it is built


def test_rank0_reaching_the_mistake_last_still_says_it(inputs: dict, tmp_path: Path) -> None:
    # Under a bare torchrun, the first rank to exit with code 2 makes torchrun end the others: a rank 0 that reaches
    # the same mistake a moment later (slower to start, to read the file) must still print its one line. Here rank 0
    # is held back a second by hand; errors.stop is the function every usage error of train.py ends in.
    script = tmp_path / "slow_rank0.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(inputs['project'])!r})\n"
        "from errors import stop\n"
        "time.sleep(1.0 if os.environ['RANK'] == '0' else 0.0)\n"
        "stop('the same mistake on every rank')\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        cwd=tmp_path, env=torchrun_env(), capture_output=True, text=True,
    )  # fmt: skip
    lines = re.findall(r"^slow_rank0\.py: error: .*$", result.stderr, flags=re.M)
    assert lines == ["slow_rank0.py: error: the same mistake on every rank"], result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr


# A new run (checkpoint.resume = "never") restarted by a bare torchrun after a fault (--max-restarts: the restarted
# ranks find this same run in the folder, and it resumes itself, instead of being refused or started over on top of
# its checkpoints; one row per step, the repeated step's first row in metrics.rewound.jsonl, every row with the run's
# id) is the fp32 project's own test_a_killed_rank_restarts_the_job_from_the_newest_checkpoint, which
# tests/test_training_runs.py runs: its kill_rank.py launch on 2 ranks with --checkpoint.resume never, which also
# ends exactly as the uninterrupted run. (Through the launch scripts' restart: tests/test_run_ownership.py's
# test_a_crash_is_restarted_and_a_new_run_continues_itself.)


# Issue 24's run-time cases, beyond the list above: each is found by a mechanism (the schema's bounds and rules in
# config.py/schema.py/model.py, the kind of every path, the ids actually in the shards), not by a case of its own.
# id -> (launch_local.sh arguments, the line). {out}: the case's output folder, {tmp}: its folder of inputs.
SCHEMA_CASES: dict[str, tuple[list[str], str]] = {
    "n-heads-negative": (
        ["--model.n_heads", "-4"],
        "model.n_heads must be 0 (the value of model.size) or more, got -4; e.g. --model.n_heads 0",
    ),
    "dim-negative": (
        ["--model.dim", "-64"],
        "model.dim must be 0 (the value of model.size) or more, got -64; e.g. --model.dim 0",
    ),
    "init-std-nan": (
        ["--model.init_std", "nan"],
        "model.init_std must be a positive number, got nan; e.g. --model.init_std 0.02",
    ),
    "head-size-odd": (
        ["--model.dim", "63", "--model.n_heads", "3", "--model.n_kv_heads", "1"],
        "model.dim / model.n_heads = 63 / 3 = 21 is odd, but rotary embeddings turn pairs of values; choose an even "
        "head size",
    ),
    # A dense project has no mixture-of-experts keys (issue 37: it renders only what its answers run); a --moe
    # project's top_k above n_experts is tests/test_moe.py's.
    "moe-key-in-a-dense-project": (
        ["--model.n_experts", "4"],
        "unknown key model.n_experts; known: size, dim, n_layers, n_heads, n_kv_heads, vocab_size, ffn_dim, "
        "max_seq_len, rope_theta, rope_type, rope_factor, rope_low_freq_factor, rope_high_freq_factor, "
        "rope_original_max_seq_len, norm_eps, init_std, tie_embeddings",
    ),
    "seed-2**32": (
        ["--training.seed", str(2**32)],
        "training.seed must be at most 4294967294, got 4294967296; e.g. --training.seed 0",
    ),
    "timeout-1e300": (
        ["--job.timeout_minutes", "1e300"],
        "job.timeout_minutes must be between 1 and 1000000, got 1e+300; e.g. --job.timeout_minutes 10",
    ),
    "synthetic-samples-1e12": (
        ["--data.synthetic_samples", str(10**12)],
        "data.synthetic_samples must be at most 2147483647, got 1000000000000; e.g. --data.synthetic_samples 4096",
    ),
    "rope-theta-nan": (
        ["--model.rope_theta", "nan"],
        "model.rope_theta must be 0 (the value of model.size) or at least 1, got nan; e.g. --model.rope_theta 0",
    ),
    "norm-eps-nan": (
        ["--model.norm_eps", "nan"],
        "model.norm_eps must be a positive number, got nan; e.g. --model.norm_eps 1e-05",
    ),
    "shard-id-above-max-id": (
        ["--data.path", "{tmp}/changed-shard"],
        "data.path {tmp}/changed-shard: shard train-00001.bin holds token id 500 (at token 7), above the largest id "
        "99 that index.json records for it: it was changed after it was written; prepare it again with "
        "scripts/prepare_data.py --output {tmp}/changed-shard-new and point --data.path there",
    ),
    "checkpoints-is-a-file": (
        [],
        "job.output_dir {out} has checkpoints, which is not a folder: the run writes its checkpoints there; move it "
        "away or choose another --job.output_dir",
    ),
    "metrics-jsonl-is-a-folder": (
        [],
        "job.output_dir {out} has metrics.jsonl, which is not a file: the run writes its metrics to it; move it away "
        "or choose another --job.output_dir",
    ),
    # Found before torchrun starts (issue 40): before, only rank 0 found it, with torchrun's traceback after the line.
    "run-json-is-a-folder": (
        [],
        "job.output_dir {out} has run.json, which is not a file: the run writes its id to it; move it away or "
        "choose another --job.output_dir",
    ),
    "config-is-a-fifo": (
        ["--config", "{tmp}/fifo.toml"],
        "config file {tmp}/fifo.toml is a FIFO; pass --config PATH of a TOML file",
    ),
}


@pytest.fixture(scope="module")
def schema_inputs(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("schema-inputs")
    write_prepared(tmp / "changed-shard")
    shard = np.fromfile(tmp / "changed-shard" / "train-00001.bin", dtype=np.uint16)
    shard[7] = 500  # index.json still says max_id 99
    shard.tofile(tmp / "changed-shard" / "train-00001.bin")
    os.mkfifo(tmp / "fifo.toml")
    return tmp


def schema_case_folder(case: str, out: Path) -> None:
    """The output folder `out` as the case `case` of SCHEMA_CASES leaves it (none: not made)."""
    if case == "checkpoints-is-a-file":
        out.mkdir(parents=True)
        (out / "checkpoints").write_text("not a folder")
    elif case == "metrics-jsonl-is-a-folder":
        (out / "metrics.jsonl").mkdir(parents=True)
    elif case == "run-json-is-a-folder":
        (out / "run.json").mkdir(parents=True)


def folder_listing(out: Path) -> list[Path]:
    return sorted(out.rglob("*")) if out.exists() else []


@pytest.fixture(scope="module")
def schema_results(projects: dict[str, Path], schema_inputs: Path) -> dict[str, list]:
    """Every case of SCHEMA_CASES, run by the project's own preflight.py as launch_local.sh runs it (NPROC=2,
    DEVICE=cpu), all in this process (preflight_cases_in_this_process); and each case's output folder before and
    after."""
    tmp, argvs, before = schema_inputs, {}, {}
    for case, (args, _) in SCHEMA_CASES.items():
        out = tmp / "out" / case
        schema_case_folder(case, out)
        before[case] = folder_listing(out)
        argv = ["--world-size", "2", "--config", "config.toml", "--job.device", "cpu", *TINY, "--job.output_dir",
                str(out), *args]  # fmt: skip
        argvs[case] = [arg.format(out=out, tmp=tmp) for arg in argv]
    results = preflight_cases_in_this_process(projects["fp32"], argvs)
    return {case: [*results[case], before[case] == folder_listing(tmp / "out" / case)] for case in SCHEMA_CASES}


@pytest.mark.parametrize("case", SCHEMA_CASES)
def test_each_schema_or_path_mistake_is_one_line_and_exit_code_2(
    case: str, schema_inputs: Path, schema_results: dict[str, list]
) -> None:
    expected = SCHEMA_CASES[case][1].format(out=schema_inputs / "out" / case, tmp=schema_inputs)
    # The line, exit code 2, nothing on stdout, and the output folder as it was.
    assert schema_results[case] == [2, "", f"preflight.py: error: {expected}\n", True]


@pytest.mark.parametrize("case", ["run-json-is-a-folder"])
def test_launch_script_refuses_what_the_schema_and_the_paths_rule_out(
    case: str, projects: dict[str, Path], schema_inputs: Path, tmp_path: Path
) -> None:
    # Through the real scripts/launch_local.sh (issue 40: run.json's kind was found only by rank 0, after torchrun
    # started): one line from one process, torchrun never started, the folder unchanged.
    tmp, out = schema_inputs, tmp_path / "out"
    schema_case_folder(case, out)
    before = folder_listing(out)
    args = [arg.format(out=out, tmp=tmp) for arg in SCHEMA_CASES[case][0]]
    result = subprocess.run(
        ["scripts/launch_local.sh", *TINY, "--job.output_dir", str(out), *args],
        cwd=projects["fp32"], env={**torchrun_env(), "NPROC": "2", "DEVICE": "cpu", "MAX_RESTARTS": "1"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    expected = SCHEMA_CASES[case][1].format(out=out, tmp=tmp)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"preflight.py: error: {expected}\n")
    assert folder_listing(out) == before


REPORT = REPO / "docs" / "bad-inputs.md"
TABLE_HEAD = "| case | arguments | the line after `error: ` |\n|---|---|---|\n"
TABLE = r"^\| case \| arguments.*\n(?:\|.*\n)+"  # a table of cases: its head and rows, up to a blank line


def report_table(cases: dict[str, tuple[list[str], str]]) -> str:
    """The Markdown rows of `cases` as docs/bad-inputs.md shows them: T is the folder of inputs, OUT the run's
    output folder, ID its run id, N a size that varies."""
    shown = {"out": "OUT", "tmp": "T", "run_id": "ID", "shard_size": "N"}
    rows = []
    for case, (args, line) in cases.items():
        arguments = shlex.join(arg.format(**shown) for arg in args) or "(the run folder as the case leaves it)"
        rows.append(f"| `{case}` | `{arguments}` | {line.format(**shown)} |")
    return TABLE_HEAD + "\n".join(rows) + "\n"


def test_the_report_is_made_from_the_cases() -> None:
    """docs/bad-inputs.md's run-time tables are CASES and SCHEMA_CASES, row for row, with their counts;
    FSDP2GEN_UPDATE_DOCS=1 writes them from the tables here."""
    report = REPORT.read_text()
    tables = re.findall(TABLE, report, flags=re.M)
    made = [report_table(CASES), report_table(SCHEMA_CASES)]
    counts = [f"{len(CASES)} cases", f"{len(SCHEMA_CASES)} schema and path cases"]
    if os.environ.get("FSDP2GEN_UPDATE_DOCS") == "1":
        assert len(tables) == len(made)
        report = re.sub(TABLE, lambda _: made.pop(0), report, flags=re.M)
        report = re.sub(r"\d+ cases( through `preflight.py`)", rf"{counts[0]}\1", report)
        report = re.sub(r"\d+ schema and path cases( through `preflight.py`)", rf"{counts[1]}\1", report)
        REPORT.write_text(report)
        return
    assert tables == made
    assert f"{counts[0]} through `preflight.py`" in report and f"{counts[1]} through `preflight.py`" in report
