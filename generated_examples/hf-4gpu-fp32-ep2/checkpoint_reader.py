"""The weights of a step-N/ folder, read in one CPU process (no torchrun), in any checkpoint style.

scripts/export.py and scripts/generate.py both read checkpoints through open_checkpoint, so what generate.py
loads is exactly what export.py writes. The folder itself (checkpoint.json, the files' checksums) is
checkpoint_files.py's, as for preflight.py and resume.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM

from checkpoint_files import corrupt_file, newest_checkpoint
from model import ModelArgs, tensor_names

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
# checkpoint_save stores the weights under "train" -> "model"; DCP flattens the keys with dots.
PREFIX = "train.model."


class CheckpointError(Exception):
    """A step-N folder that cannot be read: not a complete checkpoint, or weight files that cannot be opened."""


class CheckpointMismatch(CheckpointError):
    """A step-N folder whose weights are not those of the model in its checkpoint.json."""


def open_checkpoint(checkpoint: Path) -> tuple[dict, dict[str, tuple], Callable[[str], torch.Tensor]]:
    """The config of the run that wrote a step-N folder (its checkpoint.json), {name: (dtype, shape)} of the
    model's weights in it, and a function reading one weight as a whole CPU tensor, so that only one need be in
    memory at a time. Any checkpoint style. Of the names of a tied tensor only the first is listed (the input
    embedding), as in transformers' own files.

    Raises CheckpointError, or CheckpointMismatch when the weights are not those of the model it names.
    """
    try:
        info = json.loads((checkpoint / "checkpoint.json").read_text())
        config = info["config"]
        model_args = ModelArgs(**config["model"])
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint ({error})") from None
    # Every file against the size and checksum recorded at save (checkpoints of older projects have none).
    files = info.get("files", {})
    problem = corrupt_file(checkpoint, files, sorted(files)) if isinstance(files, dict) else "files: not a table"
    if problem is not None:
        raise CheckpointError(f"{checkpoint} is corrupt ({problem}); export an older checkpoint")
    expected = expected_weights(checkpoint, model_args)
    try:
        found, read = checkpoint_tensors(checkpoint)
    except Exception as error:  # a missing or damaged file: each library raises its own kinds
        raise CheckpointError(f"{checkpoint}: its weights cannot be read ({type(error).__name__}: {error})") from None
    missing = sorted(expected.keys() - found.keys())
    reshaped = sorted(name for name in expected.keys() & found.keys() if tuple(found[name][1]) != expected[name])
    if missing or reshaped:
        raise CheckpointMismatch(
            f"{checkpoint} does not match {model_args.path}: missing {missing}, different shapes {reshaped}"
        )
    return config, {name: found[name] for name in expected}, read


def expected_weights(checkpoint: Path, model_args: ModelArgs) -> dict[str, tuple]:
    """{name: shape} of the weights a checkpoint of `model_args` holds: the model built on the meta device, which
    allocates nothing."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_args.hf_config)
    except (OSError, ValueError) as error:  # the model folder (or the hub's copy) is gone or damaged
        raise CheckpointError(
            f"{checkpoint}: the config of its model {model_args.path} cannot be read ({error})"
        ) from None
    state = model.state_dict()
    order = {name: index for index, name in enumerate(state)}
    keep = {min(group, key=order.get) for group in tensor_names(model).values()}
    return {name: tuple(tensor.shape) for name, tensor in state.items() if name in keep}


def checkpoint_tensors(checkpoint: Path) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor]]:
    """{name: (dtype, shape)} of the checkpoint's weights, and a function reading one full tensor."""
    reader = dcp.FileSystemReader(checkpoint)
    found = {
        key.removeprefix(PREFIX): (entry.properties.dtype, tuple(entry.size))
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    # dcp.load without a process group warns that it assumes a single process, which is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def read(name: str) -> torch.Tensor:
        dtype, shape = found[name]
        tensor = torch.empty(shape, dtype=dtype)
        # DCP assembles the full tensor from the shards that every rank wrote.
        dcp.load({PREFIX + name: tensor}, storage_reader=reader, no_dist=True)
        return tensor

    return found, read


def write_safetensors(path: Path, entries: dict[str, tuple], read: Callable[[str], torch.Tensor]) -> None:
    """Write the tensors of `entries` ({name: (dtype, shape)}) to `path`, reading and writing one at a time.

    The safetensors format: an 8-byte little-endian header length, a JSON header giving each tensor's
    dtype, shape and byte range, then the raw little-endian bytes in that order.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in entries.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        span = [offset, offset + size]
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": span}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in entries:
            f.write(read(name).contiguous().reshape(-1).view(torch.uint8).numpy())


def export_parser(description: str) -> argparse.ArgumentParser:
    """scripts/export.py's command line: a checkpoint (default: the newest) and an output folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a step-N folder (default: the newest complete one)")
    parser.add_argument("--checkpoints", type=Path, default=Path("outputs/checkpoints"),
                        help="where to look for the newest checkpoint (default: %(default)s)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("exported"), help="output folder (default: %(default)s)")
    return parser


def export_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """The checkpoint export_parser's arguments name; a parser error unless --output is new or an empty folder."""
    checkpoint = args.checkpoint or newest_checkpoint(args.checkpoints)
    if checkpoint is None:
        parser.error(f"no complete checkpoint (step-N folder) in {args.checkpoints}")
    if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
        # Never replace what is there: an earlier export may be the only copy of a model.
        parser.error(f"--output {args.output} exists and is not an empty folder; choose a new --output")
    return checkpoint


def open_for_export(parser: argparse.ArgumentParser, checkpoint: Path) -> tuple[dict, dict[str, tuple], Callable]:
    """open_checkpoint for scripts/export.py: a checkpoint of another model than its checkpoint.json describes
    exits with code 1 (the files are wrong), any other problem as a usage error (exit 2)."""
    try:
        return open_checkpoint(checkpoint)
    except CheckpointMismatch as error:
        sys.exit(str(error))
    except CheckpointError as error:
        parser.exit(2, f"{error}\n")
