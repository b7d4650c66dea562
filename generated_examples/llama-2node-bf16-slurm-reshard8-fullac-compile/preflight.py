"""Find every mistake in the configuration, the data and the output folder before any rank starts.

The launch scripts run this once, in one process, before torchrun:

    python preflight.py --world-size 8 --config config.toml --training.steps 100

A mistake prints one line naming it and the fix, and exits with USAGE_ERROR (2): torchrun never starts, so
nothing is printed once per rank, and nothing is retried by --max-restarts, which stays for real faults (a
killed process, a lost node). train.py runs the same checks on rank 0 before it builds the model, for runs
started some other way (`torchrun train.py`, Ray).

A job.output_dir holds one run. A new run (checkpoint.resume = "never", or "auto" in a folder without one)
writes run.json there; its run id goes into every checkpoint.json and metrics row, and a run prunes only its
own checkpoints. A new run is refused in a folder that holds another run, so nothing we write can delete,
hide, or resume as its own another run's checkpoints. While it trains, a run holds the folder's lock
(ownership.py), and a folder inside another run's folder is refused (that run may prune it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from config import Config, parse_args
from data import INDEX_FILE, TokenShards, read_index, token_dtype
from errors import USAGE_ERROR
from model import RESUME_MAY_CHANGE, build_model
from ownership import LOCK_FILE, describe_holder, launch_id, lock_holder, run_folder_above, take_run_lock
from schema import total_memory

SCAN_TOKENS = 1 << 24  # token ids checked per read of data.path: 32-64 MiB at a time, whatever the file size
# Kept free on the disk beyond a checkpoint's estimated size: 5% of it plus this (checkpoint.json, and what the
# run writes meanwhile: metrics, logs).
SPARE_BYTES = 1 << 20
# data.py addresses samples as step x global_batch_size windows of seq_len + 1 tokens: a resume that changed
# either would re-read or skip data.
DATA_POSITION_KEYS = ("global_batch_size", "seq_len")


class PreflightError(Exception):
    """A mistake in what the user gave: the message is one line that names it and the fix."""


def preflight(config: Config, world_size: int) -> None:
    """Raise PreflightError for the first mistake that would stop (or silently spoil) a run on `world_size` ranks."""
    check_environment(config)
    vocab_size, max_seq_len = model_limits(config)
    check_layout(config, world_size, max_seq_len)
    model = meta_model(config)
    check_memory(config, world_size, vocab_size, model)
    check_data(config, vocab_size)
    output_dir = Path(config.job.output_dir)
    check_not_inside_a_run(output_dir)  # before check_output_dir creates it
    check_output_dir(output_dir)
    check_not_in_use(output_dir)
    check_run_folder(config)
    check_free_space(model, output_dir)


def check_run_folder(config: Config, launch_ids: list[str] | None = None) -> None:
    """The run job.output_dir holds (if any) is one this run may continue, or, for a new run, there is none."""
    output_dir = Path(config.job.output_dir)
    if resuming(config, launch_ids):
        checkpoint, info = newest_intact_checkpoint(output_dir / "checkpoints")
        if checkpoint is not None:
            check_resumable(checkpoint, info, config, run_id_of(output_dir))
        else:
            check_run_settings(output_dir, config)
    else:
        check_no_run(output_dir)


def restarted(output_dir: Path, launch_ids: list[str] | None = None) -> bool:
    """Whether the run in `output_dir` was started by this launch (run.json names it), which this process then
    restarts: after a failure, or a requeue of the SLURM job. Restart counters in the environment are not
    asked: any shell inside a requeued job has SLURM_RESTART_COUNT, and a run refused in a folder would be
    "restarted" by torchrun into a continuation of the run it was refused for."""
    try:
        recorded = json.loads((output_dir / "run.json").read_text()).get("launch", [])
    except (OSError, ValueError, AttributeError):
        return False  # no run.json (an unreadable one is reported by run_id_of)
    return bool(set(recorded) & set(launch_ids or [launch_id()]))


def resuming(config: Config, launch_ids: list[str] | None = None) -> bool:
    """Whether this process continues the run in job.output_dir: with checkpoint.resume = "auto", or when this
    launch started it (a restart continues its own new run, never another)."""
    return config.checkpoint.resume == "auto" or restarted(Path(config.job.output_dir), launch_ids)


def check_environment(config: Config) -> None:
    """What the job asks of this machine and its Python packages."""
    if config.job.device == "cuda" and not torch.cuda.is_available():
        raise PreflightError("job.device = 'cuda' but no CUDA device is visible; use --job.device cpu")
    profile = config.profile
    if profile.memory_snapshot_step and (config.job.device == "cpu" or not torch.cuda.is_available()):
        raise PreflightError(
            "profile.memory_snapshot_step records CUDA allocations, but this run has no CUDA device; set "
            "--profile.memory_snapshot_step 0"
        )
    for key in ("start", "memory_snapshot_step"):
        if getattr(profile, key) > config.training.steps:
            raise PreflightError(
                f"profile.{key} {getattr(profile, key)} is after the last step (training.steps "
                f"{config.training.steps}); choose a step of this run, or 0 for off"
            )


def model_limits(config: Config) -> tuple[int, int]:
    """The model's vocabulary size and longest sequence. Reading them may load the model's own config (a
    Hugging Face folder or hub id), so any failure to do that is reported here, as one line."""
    try:
        return config.model.vocab_size, config.model.max_seq_len
    except Exception as exc:  # whatever the model's loader raises: a missing folder, a bad hub id, no network
        settings = ", ".join(f"{key}={value!r}" for key, value in asdict(config.model).items())
        message = f"the model ({settings}) cannot be loaded ({reason(exc)}); fix the [model] section"
        raise PreflightError(message) from None


def meta_model(config: Config) -> torch.nn.Module:
    """config's model built on the meta device: its classes and sizes for the checks below, nothing allocated."""
    try:
        with torch.device("meta"):
            return build_model(config)
    except Exception as exc:  # a shape the model's own code refuses
        raise PreflightError(f"the model cannot be built ({reason(exc)}); fix the [model] section") from None


def check_layout(config: Config, world_size: int, max_seq_len: int) -> None:
    """The batch, the sequence length and the mesh must fit the number of ranks."""
    training, parallel = config.training, config.parallel
    if training.seq_len > max_seq_len:
        raise PreflightError(
            f"training.seq_len ({training.seq_len}) exceeds model.max_seq_len ({max_seq_len}); "
            f"use --training.seq_len {max_seq_len} or less"
        )
    tp = 1
    shard = world_size // (parallel.dp_replicate * tp) if parallel.dp_shard == -1 else parallel.dp_shard
    if world_size > 1 and parallel.dp_replicate * shard * tp != world_size:
        raise PreflightError(
            f"parallel.dp_replicate x dp_shard x tp = {parallel.dp_replicate} x {parallel.dp_shard} x {tp} does not "
            f"match the {world_size} ranks; choose dp_replicate (and tp) whose product divides {world_size} "
            "(dp_shard = -1 takes the rest)"
        )
    data_ranks = world_size // tp  # the ranks of one tp group read the same samples
    per_step = data_ranks * training.grad_accum_steps
    if training.global_batch_size % per_step:
        fitting = max(per_step, training.global_batch_size // per_step * per_step)
        raise PreflightError(
            f"training.global_batch_size ({training.global_batch_size}) must be divisible by data-parallel ranks "
            f"x grad_accum_steps ({data_ranks} x {training.grad_accum_steps}); e.g. --training.global_batch_size "
            f"{fitting}"
        )
    reshard = parallel.reshard_after_forward
    # Groups at least as large as the shard group (a run on fewer GPUs than configured) reshard fully.
    if world_size > 1 and not isinstance(reshard, bool) and reshard < shard and shard % reshard:
        raise PreflightError(
            f"parallel.reshard_after_forward = {reshard} must divide the {shard} ranks each parameter is sharded "
            "over; use true, false or a divisor (e.g. the GPUs per node)"
        )


def check_memory(config: Config, world_size: int, vocab_size: int, model: torch.nn.Module) -> None:
    """What each rank must hold at least, against what this machine has (its RAM plus one GPU's memory), before
    anything is allocated: a shape or batch that cannot fit is one line here, not an out-of-memory crash on every
    rank. A lower bound, so it never refuses a run that fits: 16 bytes per model value (fp32 weights, gradients
    and Adam's two moments) split over the ranks, and 8 bytes per logit of one micro-batch (the fp32 logits and
    their log-probabilities, both alive in the loss)."""
    training = config.training
    available = total_memory()
    if config.job.device != "cpu" and torch.cuda.is_available():
        available += torch.cuda.get_device_properties(0).total_memory
    values = sum(tensor.numel() for tensor in [*model.parameters(), *model.buffers()])
    model_bytes = 16 * values // world_size
    micro_batch = -(-training.global_batch_size // (world_size * training.grad_accum_steps))
    logit_bytes = 8 * micro_batch * training.seq_len * vocab_size
    if model_bytes + logit_bytes > available:
        raise PreflightError(
            f"each of the {world_size} ranks needs at least {model_bytes / 2**30:.1f} GiB for the model and its "
            f"optimizer state and {logit_bytes / 2**30:.1f} GiB for a micro-batch's logits, more than this "
            f"machine's {available / 2**30:.1f} GiB; use a smaller [model], --training.global_batch_size or "
            "--training.seq_len, more --training.grad_accum_steps, or more ranks"
        )


def check_data(config: Config, vocab_size: int) -> None:
    """data.path (and, with eval.every, its validation split) holds enough valid samples for this run."""
    path, training = Path(config.data.path), config.training
    if not config.data.path:
        return  # synthetic tokens: always valid, and validation has its own held-out synthetic samples
    if path.is_dir():
        check_prepared_folder(path, training.seq_len, vocab_size)
        if config.eval.every:
            needed = config.eval.batches * training.global_batch_size
            found = len(TokenShards(path, "val", training.seq_len))
            if found < needed:
                raise PreflightError(
                    f"data.path {path} has {found} validation samples of training.seq_len + 1 tokens, fewer than "
                    f"eval.batches x training.global_batch_size = {needed}; lower --eval.batches, prepare with a "
                    "larger --val-fraction, or set --eval.every 0"
                )
        return
    check_token_file(path, training.seq_len, vocab_size)
    if config.eval.every:
        raise PreflightError(
            f"data.path {path} is a flat token file, which has no validation split; prepare a folder with "
            "scripts/prepare_data.py, or set --eval.every 0"
        )


def check_prepared_folder(path: Path, seq_len: int, vocab_size: int) -> None:
    """A folder written by scripts/prepare_data.py: finished, for this vocabulary, every shard whole."""
    fix = f"prepare it again with scripts/prepare_data.py --output {path}-new and point --data.path there"
    if not (path / INDEX_FILE).is_file():
        raise PreflightError(
            f"data.path {path} is a folder without {INDEX_FILE}; give a folder written by scripts/prepare_data.py "
            "(or a flat token file)"
        )
    try:
        index = read_index(path)
        splits = {split: [(shard["file"], int(shard["tokens"]), int(shard["max_id"])) for shard in index[split]]
                  for split in ("train", "val")}  # fmt: skip
        dtype, vocabulary, complete = np.dtype(index["dtype"]), int(index["vocab_size"]), index["complete"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PreflightError(
            f"data.path {path}/{INDEX_FILE} cannot be read ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    if not complete:
        raise PreflightError(
            f"data.path {path} is not finished: scripts/prepare_data.py stopped before the end; run it again with "
            "the same arguments to finish it"
        )
    if index.get("masks"):
        raise PreflightError(
            f"data.path {path} holds chat data with a loss mask (scripts/prepare_chat.py), which a --task sft "
            "project trains on; prepare plain text with scripts/prepare_data.py"
        )
    if vocabulary > vocab_size:
        raise PreflightError(
            f"data.path {path} was tokenized with a vocabulary of {vocabulary} tokens ({index.get('tokenizer')}), "
            f"but model.vocab_size is {vocab_size}; prepare the data with the model's tokenizer"
        )
    for file, tokens, largest in splits["train"] + splits["val"]:
        shard = path / file
        if not shard.is_file():
            raise PreflightError(f"data.path {path}: shard {file} is missing; {fix}")
        size = shard.stat().st_size
        if size != tokens * dtype.itemsize:
            raise PreflightError(
                f"data.path {path}: shard {file} has {size} bytes, but index.json says {tokens} {dtype.name} token "
                f"ids ({tokens * dtype.itemsize} bytes); it is truncated or was replaced; {fix}"
            )
        if largest >= vocab_size:
            raise PreflightError(
                f"data.path {path}: shard {file} holds token id {largest} >= model.vocab_size {vocab_size}; "
                "prepare the data with the model's tokenizer"
            )
        # index.json's max_id is what the shard held when written: a shard changed since (a bad copy, flipped
        # bits) may hold more. Its ids are read, as in check_token_file (~1 s per GiB of shards, once per launch).
        actual, position = largest_id(np.memmap(shard, dtype=dtype, mode="r") if size else np.empty(0, dtype), largest)
        if actual > largest:
            raise PreflightError(
                f"data.path {path}: shard {file} holds token id {actual} (at token {position}), above the largest "
                f"id {largest} that index.json records for it: it was changed after it was written; {fix}"
            )
    if len(TokenShards(path, "train", seq_len)) == 0:
        raise PreflightError(
            f"data.path {path} holds no training sample of training.seq_len + 1 = {seq_len + 1} tokens; give it "
            "more text or a shorter --training.seq_len"
        )


def check_token_file(path: Path, seq_len: int, vocab_size: int) -> None:
    """data.path: a flat file of token ids that all fit the model's vocabulary, long enough for one sample."""
    dtype = np.dtype(token_dtype(vocab_size))
    fix = (
        "point --data.path at a folder written by scripts/prepare_data.py or a flat file of token ids, or set "
        "--data.path '' for synthetic tokens"
    )
    if not path.exists():
        raise PreflightError(f"data.path {path} does not exist; {fix}")
    if not path.is_file():
        raise PreflightError(f"data.path {path} is not a file; {fix}")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise PreflightError(
            f"data.path {path} has {size} bytes, not a whole number of {dtype.name} token ids ({dtype.itemsize} "
            f"bytes each for model.vocab_size {vocab_size}); it was written for another vocabulary or is truncated"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype)
    if len(tokens) < seq_len + 1:
        raise PreflightError(
            f"data.path {path} holds {len(tokens)} tokens, fewer than training.seq_len + 1 = {seq_len + 1}; "
            "give it more data or a shorter --training.seq_len"
        )
    # Every id, not a sample: an id >= vocab_size fails inside the embedding (on a GPU, a device-side assert
    # that names nothing).
    largest, position = largest_id(tokens, vocab_size - 1)
    if largest >= vocab_size:
        raise PreflightError(
            f"data.path {path} holds token id {largest} >= model.vocab_size {vocab_size} (first at token "
            f"{position}); tokenize it with the model's tokenizer"
        )


def largest_id(tokens: np.ndarray, limit: int) -> tuple[int, int]:
    """The largest id of `tokens` (a memmap) and where the first id above `limit` is (-1: none), stopping at the
    chunk that holds one. Reading in chunks keeps memory flat for files of any size (~1 s per GiB)."""
    largest = 0
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        largest = max(largest, int(chunk.max()))
        if largest > limit:
            return largest, start + int(np.argmax(chunk > limit))
    return largest, -1


def check_output_dir(output_dir: Path) -> None:
    """job.output_dir exists (or is created here) and takes files: found now, not by a rank mid-run."""
    if output_dir.exists() and not output_dir.is_dir():
        raise PreflightError(
            f"job.output_dir {output_dir} is a file, not a folder; choose a folder with --job.output_dir"
        )
    # What the run writes there must be able to take its place: found now, not at the first save or log line.
    for name, folder in (("checkpoints", True), ("metrics.jsonl", False)):
        found = output_dir / name
        if found.exists() and found.is_dir() != folder:
            should = "a folder" if folder else "a file"
            raise PreflightError(
                f"job.output_dir {output_dir} has {name}, which is not {should}: the run writes its "
                f"{'checkpoints there' if folder else 'metrics to it'}; move it away or choose another --job.output_dir"
            )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PreflightError(
            f"job.output_dir {output_dir} cannot be written ({exc.strerror or exc}); choose a writable folder "
            "with --job.output_dir"
        ) from None


def check_no_run(output_dir: Path) -> None:
    """A new run (checkpoint.resume = "never") must not mix with, prune or resume another run's files."""
    found = [name for name in ("run.json", "metrics.jsonl") if (output_dir / name).exists()]
    checkpoints = sorted(p.name for p in (output_dir / "checkpoints").glob("step-*"))
    if checkpoints:
        found.append(f"checkpoints {', '.join(checkpoints)}")
    if found:
        raise PreflightError(
            f"job.output_dir {output_dir} already holds a run ({'; '.join(found)}); checkpoint.resume = 'never' "
            "starts a new run, which must not mix with it: give the new run its own --job.output_dir, or "
            "continue that run with --checkpoint.resume auto"
        )


def check_not_inside_a_run(output_dir: Path) -> None:
    """job.output_dir must not lie inside another run's folder, whose run may prune (delete) it."""
    found = run_folder_above(output_dir)
    if found is not None:
        folder, evidence = found
        raise PreflightError(
            f"job.output_dir {output_dir} is inside {folder}, the folder of another run (it holds {evidence}), "
            f"which may delete it when it prunes its checkpoints; choose a --job.output_dir outside {folder}"
        )


def check_not_in_use(output_dir: Path) -> None:
    """No other launch's run is training in job.output_dir now (one of this launch, a restart's previous
    attempt still ending, is waited for by start_run)."""
    holder = lock_holder(output_dir)
    if holder is not None and not set(holder.get("launch", [])) & {launch_id()}:
        raise PreflightError(describe_holder(output_dir, holder))


def check_run_settings(output_dir: Path, config: Config) -> None:
    """run.json of a run that has no checkpoint yet: it is continued only by the same model, global batch size
    and sequence length, as a checkpoint would be (check_resumable)."""
    try:
        recorded = json.loads((output_dir / "run.json").read_text())
    except (OSError, ValueError):
        return  # no run.json; an unreadable one is reported by run_id_of
    if not isinstance(recorded, dict) or "model" not in recorded:
        return
    changed = changed_model(recorded["model"], config) + [
        f"training.{key} {recorded['training'].get(key)!r} -> {getattr(config.training, key)!r}"
        for key in DATA_POSITION_KEYS
        if recorded["training"].get(key) != getattr(config.training, key)
    ]
    if changed:
        raise PreflightError(
            f"{output_dir} holds run {recorded.get('run_id')} (run.json), which has no checkpoint yet and other "
            f"settings ({', '.join(changed)}); continue it with its settings, or start a new run in another "
            "--job.output_dir"
        )


def start_run(output_dir: Path, config: Config, launch_ids: list[str]) -> str:
    """Make `output_dir` this run's and return its id: the one the folder holds when resuming, or a new one.

    Called on rank 0 after preflight(). Locks the folder for the life of this process (ownership.py), then
    checks it again under the lock: between preflight and now another launch may have started, or ended, a run
    here. `launch_ids`: this launch's id on each node, recorded in run.json for its restarts.
    """
    try:
        holder = take_run_lock(output_dir, launch_ids)
    except OSError as exc:
        raise PreflightError(
            f"{output_dir / LOCK_FILE} cannot be opened ({exc.strerror or exc}); it must be a file this user can "
            "write, or absent"
        ) from None
    if holder is not None:
        raise PreflightError(describe_holder(output_dir, holder))
    check_run_folder(config, launch_ids)
    run_file = output_dir / "run.json"
    run_id = run_id_of(output_dir) if resuming(config, launch_ids) else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
    if not run_file.exists():
        started = datetime.now(UTC).isoformat(timespec="seconds")
        # What a resume of this run must keep (check_run_settings), for as long as it has no checkpoint.
        settings = {"model": asdict(config.model), "training": {key: getattr(config.training, key)
                                                                 for key in DATA_POSITION_KEYS}}  # fmt: skip
        record = {"run_id": run_id, "started": started, "launch": launch_ids, **settings}
        staging = run_file.with_suffix(".json.tmp")
        staging.write_text(json.dumps(record) + "\n")
        staging.rename(run_file)
    return run_id


def run_id_of(output_dir: Path) -> str | None:
    """The run `output_dir` holds: run.json's id; for checkpoints copied in without it, the newest one's."""
    run_file = output_dir / "run.json"
    if run_file.exists():
        try:
            return json.loads(run_file.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PreflightError(
                f"{run_file} cannot be read ({type(exc).__name__}: {exc}); restore it, or start a new run in "
                "another --job.output_dir"
            ) from None
    newest = newest_checkpoint(output_dir / "checkpoints")
    return read_checkpoint_info(newest).get("run_id") if newest is not None else None


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """step-N folders (never step-N.tmp), oldest first."""
    found = [p for p in checkpoint_dir.glob("step-*") if p.name.removeprefix("step-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    complete = complete_checkpoints(checkpoint_dir)
    return complete[-1] if complete else None


def read_checkpoint_info(path: Path) -> dict:
    """checkpoint.json of `path`, once the files it describes are there and whole."""
    try:
        return load_checkpoint_info(path)
    except (OSError, ValueError) as exc:
        raise PreflightError(unreadable(path, exc)) from None


def load_checkpoint_info(path: Path) -> dict:
    """checkpoint.json of `path`, once the files it describes are there and whole; raises OSError or ValueError."""
    info = json.loads((path / "checkpoint.json").read_text())
    if not isinstance(info, dict) or not {"step", "world_size", "model_only", "config"} <= info.keys():
        raise ValueError("checkpoint.json lacks step, world_size, model_only or config")
    check_checkpoint_files(path, info)
    return info


def newest_intact_checkpoint(checkpoint_dir: Path) -> tuple[Path | None, dict]:
    """The newest complete step-N/ whose files are whole, and its checkpoint.json; (None, {}) if there is none.

    A damaged newer one is passed over, as train.py's resume does (which also verifies the files' checksums, on
    every rank, and sets a damaged one aside). None whole: PreflightError, never a silent fresh start.
    """
    damaged = []
    for path in reversed(complete_checkpoints(checkpoint_dir)):
        try:
            return path, load_checkpoint_info(path)
        except (OSError, ValueError) as exc:
            damaged.append((path, reason(exc)))
    if damaged:
        raise PreflightError(no_intact_checkpoint(damaged))
    return None, {}


def no_intact_checkpoint(damaged: list[tuple[Path, str]]) -> str:
    """The line for a run whose checkpoints (`damaged`: (folder, why), newest first) are all corrupt."""
    (newest, why), older = damaged[0], damaged[1:]
    nor = "".join(f", nor can {path.name} ({reason})" for path, reason in older)
    return (
        f"checkpoint {newest} cannot be loaded ({why}){nor}, and no older checkpoint is left to resume from; restore "
        "it from a copy, or start a new run in another --job.output_dir"
    )


def reason(exc: BaseException) -> str:
    """An exception as a short reason: its type and the first line of its message."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"


def check_checkpoint_files(path: Path, info: dict) -> None:
    """The files of a full checkpoint (model.safetensors) or of a DCP one (.metadata and its shards) are there
    and whole, and as large as when saved (checkpoint.json's "files"; their checksums are verified by the ranks
    at load). Told apart by their files, so that this module is the same in every checkpoint style."""
    files = info.get("files", {})  # none in checkpoints of older projects
    if not isinstance(files, dict) or not all(
        isinstance(record, dict) and isinstance(record.get("bytes"), int) and isinstance(record.get("sha256"), str)
        for record in files.values()
    ):
        raise ValueError('checkpoint.json: "files" is not {name: {"bytes": size, "sha256": checksum}}')
    if (path / "model.safetensors").is_file():
        check_full_checkpoint(path, info)
    else:
        check_dcp_checkpoint(path)
    for name, record in files.items():
        size = (path / name).stat().st_size
        if size != record["bytes"]:
            raise ValueError(f"{name} has {size} bytes, {record['bytes']} when saved")


def check_full_checkpoint(path: Path, info: dict) -> None:
    """model.safetensors with a readable header; train_state.pt unless the checkpoint holds the model only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path / "model.safetensors", framework="pt") as weights:
            weights.keys()
    except SafetensorError as exc:
        raise ValueError(f"model.safetensors: {exc}") from None
    if not info["model_only"] and not (path / "train_state.pt").is_file():
        raise FileNotFoundError(f"no train_state.pt in {path}")


def check_dcp_checkpoint(path: Path) -> None:
    """DCP's .metadata can be read, and every data file it names holds the bytes it points to."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no .metadata in {path}")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # unpickling garbage can raise almost anything
        raise ValueError(f".metadata is not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in needed.items():
        actual = (path / name).stat().st_size
        if actual < size:
            raise ValueError(f"{name} has {actual} bytes, .metadata expects at least {size}")


def file_record(path: Path) -> dict:
    """What checkpoint.json records of each checkpoint file: its size and SHA-256, read in chunks (flat memory;
    ~1.3 GB/s on a core with SHA instructions)."""
    with path.open("rb") as file:
        return {"bytes": os.fstat(file.fileno()).st_size, "sha256": hashlib.file_digest(file, "sha256").hexdigest()}


def corrupt_file(path: Path, files: dict, names: list[str]) -> str | None:
    """The first of `names` (files of the checkpoint `path`) that differs from its record in `files`, as "NAME:
    why"; None if all are intact."""
    for name in names:
        try:
            found = file_record(path / name)
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if found["bytes"] != files[name]["bytes"]:
            return f"{name}: {found['bytes']} bytes, {files[name]['bytes']} when saved"
        if found["sha256"] != files[name]["sha256"]:
            return f"{name}: checksum mismatch"
    return None


def checkpoint_bytes(tensors: list[torch.Tensor], model_only: bool = False) -> int:
    """About how many bytes one checkpoint of a model takes, summed over every rank's files, in any style.

    `tensors`: the model's parameters and buffers. Each is saved, with AdamW's two moments (exp_avg, exp_avg_sq:
    its size and dtype each) if it trains, unless `model_only`; plus ~4 KiB of headers per tensor. A sharded
    parameter (DTensor) counts whole, so a meta model and a rank's sharded one give the same size.
    """
    total = 0
    for tensor in tensors:
        copies = 3 if tensor.requires_grad and not model_only else 1
        total += copies * (tensor.numel() * tensor.element_size() + 4096)
    return total


def short_of_space(checkpoint_dir: Path, size: int) -> str | None:
    """None if a checkpoint of `size` bytes fits on the disk of `checkpoint_dir` (with room to spare), else how
    far it is from fitting. Older checkpoints stay until the new one is complete, so only free space counts."""
    needed = space_needed(size)
    existing = next(folder for folder in (checkpoint_dir, *checkpoint_dir.parents) if folder.exists())
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return f"needs about {human_size(needed)} on the disk of {checkpoint_dir}, which has {human_size(free)} free"


def space_needed(size: int) -> int:
    """The free space a checkpoint of `size` bytes (checkpoint_bytes) asks for: the size, with room to spare."""
    return size + size // 20 + SPARE_BYTES


def human_size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def check_free_space(model: torch.nn.Module, output_dir: Path) -> None:
    """The next checkpoint of `model` (built on the meta device) fits on job.output_dir's disk (each save checks
    again, with the trained model)."""
    short = short_of_space(output_dir / "checkpoints", checkpoint_bytes([*model.parameters(), *model.buffers()]))
    if short is not None:
        raise PreflightError(
            f"disk full: a checkpoint of this model {short}; free space there, or give a --job.output_dir on a "
            "disk with room"
        )


def check_resumable(path: Path, info: dict, config: Config, run_id: str | None) -> None:
    """`path` must continue this run as configured: same run, same model, same data positions."""
    saved_run = info.get("run_id")
    if run_id is not None and saved_run is not None and saved_run != run_id:
        raise PreflightError(
            f"{path} belongs to run {saved_run}, but {path.parent.parent} holds run {run_id} (run.json); move the "
            "checkpoint to its own run's folder, or start a new run in another --job.output_dir"
        )
    new_run = "start a new run in another --job.output_dir"
    saved = info["config"]
    changed = changed_model(saved["model"], config)
    if changed:
        raise PreflightError(
            f"{path} holds a different model ({', '.join(changed)}); resume with the model settings in "
            f"{path / 'checkpoint.json'}, or {new_run}"
        )
    for key in DATA_POSITION_KEYS:
        before, now = saved["training"][key], getattr(config.training, key)
        if before != now:
            raise PreflightError(
                f"{path} was saved with training.{key} {before}, but this run has {now}; resume with "
                f"--training.{key} {before}, or {new_run}"
            )
    if info["model_only"] and info["step"] < config.training.steps:
        raise PreflightError(
            f"{path} is a model-only final checkpoint (checkpoint.model_only_final) of a run that ended at step "
            f"{info['step']}: it cannot continue training to step {config.training.steps}. Delete it "
            f"(rm -r {path}) to resume from the previous checkpoint, or {new_run}"
        )


def changed_model(saved_model: dict, config: Config) -> list[str]:
    """The model settings of `config` that differ from `saved_model` (a checkpoint's or run.json's), as
    "model.KEY before -> now": every one must match, except those model.py lists as free to change on resume."""
    return [
        f"model.{key} {saved_model.get(key)!r} -> {value!r}"
        for key, value in asdict(config.model).items()
        if key not in RESUME_MAY_CHANGE and saved_model.get(key) != value
    ]


def unreadable(path: Path, exc: BaseException) -> str:
    return (
        f"checkpoint {path} cannot be loaded ({reason(exc)}); it is probably incomplete or corrupt. "
        f"Delete it (rm -r {path}) to resume from the previous checkpoint, or start a new run in another "
        "--job.output_dir"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Check a run before torchrun starts it", allow_abbrev=False)
    parser.add_argument("--world-size", type=int, required=True, help="ranks the run will have (nodes x GPUs)")
    args, rest = parser.parse_known_args()
    if args.world_size < 1:
        parser.exit(USAGE_ERROR, f"{parser.prog}: error: --world-size must be at least 1, got {args.world_size}\n")
    config = parse_args(rest)
    try:
        preflight(config, args.world_size)
    except PreflightError as exc:
        parser.exit(USAGE_ERROR, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    main()
