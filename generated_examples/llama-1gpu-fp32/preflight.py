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
hide, or resume as its own another run's checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from config import Config, parse_args
from data import INDEX_FILE, TokenShards, read_index, token_dtype
from errors import USAGE_ERROR
from model import RESUME_MAY_CHANGE

SCAN_TOKENS = 1 << 24  # token ids checked per read of data.path: 32-64 MiB at a time, whatever the file size


class PreflightError(Exception):
    """A mistake in what the user gave: the message is one line that names it and the fix."""


def preflight(config: Config, world_size: int) -> None:
    """Raise PreflightError for the first mistake that would stop (or silently spoil) a run on `world_size` ranks."""
    check_environment(config)
    vocab_size, max_seq_len = model_limits(config)
    check_layout(config, world_size, max_seq_len)
    check_data(config, vocab_size)
    output_dir = Path(config.job.output_dir)
    check_output_dir(output_dir)
    if resuming(config):
        checkpoint = newest_checkpoint(output_dir / "checkpoints")
        if checkpoint is not None:
            check_resumable(checkpoint, read_checkpoint_info(checkpoint), config, run_id_of(output_dir))
    else:
        check_no_run(output_dir)


def restarted() -> bool:
    """True in a process that torchrun (--max-restarts) or SLURM (--requeue) started again after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 or int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0


def resuming(config: Config) -> bool:
    """Whether this process continues the run in job.output_dir. A restart after a failure always does:
    with checkpoint.resume = "never" the folder then holds the run this launch started."""
    return config.checkpoint.resume == "auto" or restarted()


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
        reason = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise PreflightError(
            f"the model ({settings}) cannot be loaded ({type(exc).__name__}: {reason}); fix the [model] section"
        ) from None


def check_layout(config: Config, world_size: int, max_seq_len: int) -> None:
    """The batch, the sequence length and the mesh must fit the number of ranks."""
    training, parallel = config.training, config.parallel
    if training.seq_len > max_seq_len:
        raise PreflightError(
            f"training.seq_len ({training.seq_len}) exceeds model.max_seq_len ({max_seq_len}); "
            f"use --training.seq_len {max_seq_len} or less"
        )
    if world_size == 1:
        return  # one process: no mesh to lay out
    tp = 1
    shard = world_size // (parallel.dp_replicate * tp) if parallel.dp_shard == -1 else parallel.dp_shard
    if parallel.dp_replicate * shard * tp != world_size:
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
    if not isinstance(reshard, bool) and reshard < shard and shard % reshard:
        raise PreflightError(
            f"parallel.reshard_after_forward = {reshard} must divide the {shard} ranks each parameter is sharded "
            "over; use true, false or a divisor (e.g. the GPUs per node)"
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
    # that names nothing). Reading in chunks keeps memory flat for files of any size (~1 s per GiB).
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        largest = int(chunk.max())
        if largest >= vocab_size:
            position = start + int(np.argmax(chunk >= vocab_size))
            raise PreflightError(
                f"data.path {path} holds token id {largest} >= model.vocab_size {vocab_size} (first at token "
                f"{position}); tokenize it with the model's tokenizer"
            )


def check_output_dir(output_dir: Path) -> None:
    """job.output_dir exists (or is created here) and takes files: found now, not by a rank mid-run."""
    if output_dir.exists() and not output_dir.is_dir():
        raise PreflightError(
            f"job.output_dir {output_dir} is a file, not a folder; choose a folder with --job.output_dir"
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


def start_run(output_dir: Path, config: Config) -> str:
    """The id of the run that trains in `output_dir` from now on: the one it holds when resuming, or a new one.

    Called on rank 0 after preflight(), which made sure a new run finds no other run's files here.
    """
    run_file = output_dir / "run.json"
    run_id = run_id_of(output_dir) if resuming(config) else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
    if not run_file.exists():
        started = datetime.now(UTC).isoformat(timespec="seconds")
        staging = run_file.with_suffix(".json.tmp")
        staging.write_text(json.dumps({"run_id": run_id, "started": started}) + "\n")
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
        info = json.loads((path / "checkpoint.json").read_text())
        if not isinstance(info, dict) or not {"step", "world_size", "model_only", "config"} <= info.keys():
            raise ValueError("checkpoint.json lacks step, world_size, model_only or config")
        check_checkpoint_files(path, info)
    except (OSError, ValueError) as exc:
        raise PreflightError(unreadable(path, exc)) from None
    return info


def check_checkpoint_files(path: Path, info: dict) -> None:
    """The files of a full checkpoint (model.safetensors) or of a DCP one (.metadata and its shards) are there
    and whole. Told apart by their files, so that this module is the same in every checkpoint style."""
    if (path / "model.safetensors").is_file():
        check_full_checkpoint(path, info)
    else:
        check_dcp_checkpoint(path)


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
    # Every model setting must match, except those model.py lists as free to change on resume.
    changed = [
        f"model.{key} {saved['model'].get(key)!r} -> {value!r}"
        for key, value in asdict(config.model).items()
        if key not in RESUME_MAY_CHANGE and saved["model"].get(key) != value
    ]
    if changed:
        raise PreflightError(
            f"{path} holds a different model ({', '.join(changed)}); resume with the model settings in "
            f"{path / 'checkpoint.json'}, or {new_run}"
        )
    # data.py addresses samples as step x global_batch_size windows of seq_len + 1 tokens: changing either
    # would make the resumed run re-read or skip data.
    for key in ("global_batch_size", "seq_len"):
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


def unreadable(path: Path, exc: BaseException) -> str:
    reason = next((line for line in str(exc).splitlines() if line.strip()), "")
    return (
        f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {reason}); it is probably incomplete or corrupt. "
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
