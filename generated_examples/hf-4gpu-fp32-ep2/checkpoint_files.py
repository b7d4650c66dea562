"""The checkpoint folder format, in every checkpoint style: where the step-N/ folders are, what their
checkpoint.json holds, whether their files are whole, and how much disk one takes.

A module of its own, apart from checkpoint_common.py (the train-time state a checkpoint holds: TrainState, the
RNG states, the collective resume), because preflight.py, scripts/export.py, scripts/generate.py and
tests/kill_rank.py read folders without training: it imports no torch at import time (safetensors and DCP's
reader only inside the checks that open a file), so those start fast.

Its errors: CheckpointFolderError (one line naming the folder and the fix) for a checkpoint a run cannot use;
OSError or ValueError from load_checkpoint_info, for callers that try the next folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from config import saved_config
from errors import reason

if TYPE_CHECKING:
    import torch

# Kept free on the disk beyond a checkpoint's estimated size: 5% of it plus this (checkpoint.json, and what the
# run writes meanwhile: metrics, logs).
SPARE_BYTES = 1 << 20


# The fields of checkpoint.json (checkpoint_common.checkpoint_info): name, type(s), smallest value. Its "config" is
# read by config.saved_config, its "files" by check_checkpoint_files.
INFO_FIELDS = (
    ("step", (int,), 0),
    ("world_size", (int,), 1),
    ("model_only", (bool,), None),
    ("device", (str,), None),
    ("run_id", (str,), None),
)
# Absent from checkpoints of older projects.
OPTIONAL_FIELDS = ("run_id",)


class CheckpointFolderError(Exception):
    """A checkpoint the run cannot use: the message is one line that names it and the fix."""


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """step-N folders (never step-N.tmp), oldest first."""
    found = [p for p in checkpoint_dir.glob("step-*") if p.name.removeprefix("step-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    complete = complete_checkpoints(checkpoint_dir)
    return complete[-1] if complete else None


def load_checkpoint_info(path: Path) -> dict:
    """checkpoint.json of `path`, once the files it describes are there and whole; raises OSError or ValueError.

    Read through a schema, as config.toml is: each field of the type checkpoint_common.checkpoint_info writes, and
    its "config" every section of config.py's Config, each value of its key's type (config.saved_config). A
    checkpoint.json of any other shape is a damaged checkpoint, passed over like one whose files are damaged."""
    info = json.loads((path / "checkpoint.json").read_text())
    if not isinstance(info, dict):
        raise ValueError(f"checkpoint.json is not a table but {type(info).__name__}")
    for key, kinds, low in INFO_FIELDS:
        value = info.get(key)
        if key not in info and key in OPTIONAL_FIELDS:
            continue
        wrong_type = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
        if wrong_type or (low is not None and value < low):
            kind = " or ".join(kind.__name__ for kind in kinds) + (f" of at least {low}" if low is not None else "")
            raise ValueError(f"checkpoint.json: {key} is not {kind} but {value!r:.60}")
    saved_config(info.get("config"))
    check_checkpoint_files(path, info)
    return info


def newest_intact_checkpoint(checkpoint_dir: Path) -> tuple[Path | None, dict]:
    """The newest complete step-N/ whose files are whole, and its checkpoint.json; (None, {}) if there is none.

    A damaged newer one is passed over, as train.py's resume does (which also verifies the files' checksums, on
    every rank, and sets a damaged one aside). None whole: CheckpointFolderError, never a silent fresh start.
    """
    damaged = []
    for path in reversed(complete_checkpoints(checkpoint_dir)):
        try:
            return path, load_checkpoint_info(path)
        except (OSError, ValueError) as exc:
            damaged.append((path, reason(exc)))
    if damaged:
        raise CheckpointFolderError(no_intact_checkpoint(damaged))
    return None, {}


def no_intact_checkpoint(damaged: list[tuple[Path, str]]) -> str:
    """The line for a run whose checkpoints (`damaged`: (folder, why), newest first) are all corrupt."""
    (newest, why), older = damaged[0], damaged[1:]
    nor = "".join(f", nor can {path.name} ({reason})" for path, reason in older)
    return (
        f"checkpoint {newest} cannot be loaded ({why}){nor}, and no older checkpoint is left to resume from; restore "
        "it from a copy, or start a new run in another --job.output_dir"
    )


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


def check_free_space(tensors: list[torch.Tensor], checkpoint_dir: Path) -> None:
    """The next checkpoint of a model (`tensors`: its parameters and buffers, on the meta device) fits on the disk
    of `checkpoint_dir` (each save checks again, with the trained model)."""
    short = short_of_space(checkpoint_dir, checkpoint_bytes(tensors))
    if short is not None:
        raise CheckpointFolderError(
            f"disk full: a checkpoint of this model {short}; free space there, or give a --job.output_dir on a "
            "disk with room"
        )
