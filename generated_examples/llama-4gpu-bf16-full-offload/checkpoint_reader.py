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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from checkpoint_files import corrupt_file, newest_checkpoint
from model import Model, ModelArgs

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class CheckpointError(Exception):
    """A step-N folder that cannot be read: not a complete checkpoint, or weight files that cannot be opened."""


class CheckpointMismatch(CheckpointError):
    """A step-N folder whose weights are not those of the model in its checkpoint.json."""


def open_checkpoint(checkpoint: Path) -> tuple[dict, dict[str, tuple], Callable[[str], torch.Tensor]]:
    """The config of the run that wrote a step-N folder (its checkpoint.json), {name: (dtype, shape)} of the
    model's weights in it, and a function reading one weight as a whole CPU tensor, so that only one need be in
    memory at a time. Any checkpoint style.

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
    shapes = {name: shape for name, (_, shape) in found.items()}
    if shapes != expected:
        missing, unexpected = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
        reshaped = sorted(name for name in shapes.keys() & expected.keys() if shapes[name] != expected[name])
        raise CheckpointMismatch(
            f"{checkpoint} does not match the model in its checkpoint.json: missing {missing}, "
            f"unexpected {unexpected}, different shapes {reshaped}"
        )
    return config, found, read


def expected_weights(checkpoint: Path, model_args: ModelArgs) -> dict[str, tuple]:
    """{name: shape} of the weights a checkpoint of `model_args` holds: the model built on the meta device, which
    allocates nothing."""
    with torch.device("meta"):
        return {name: tuple(tensor.shape) for name, tensor in Model(model_args).state_dict().items()}


def checkpoint_tensors(checkpoint: Path) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor]]:
    """{name: (dtype, shape)} of the checkpoint's model.safetensors, and a function reading one tensor."""
    weights = safe_open(checkpoint / "model.safetensors", framework="pt")
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    found = {}
    for name in weights.keys():
        tensor_slice = weights.get_slice(name)
        found[name] = (dtypes[tensor_slice.get_dtype()], tuple(tensor_slice.get_shape()))
    return found, weights.get_tensor


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
