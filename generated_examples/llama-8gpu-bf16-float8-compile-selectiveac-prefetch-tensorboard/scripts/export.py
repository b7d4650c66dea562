"""Export a checkpoint as one safetensors file + config.json, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported

The weights then load into a plain, non-distributed model:

    model = Transformer(ModelArgs(**json.loads(Path("exported/config.json").read_text())))
    model.init_weights(seed=0)  # computes the rotary tables, which are not saved; the weights are replaced next
    model.load_state_dict(safetensors.torch.load_file("exported/model.safetensors"))
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from model import ModelArgs, Transformer  # noqa: E402
from preflight import complete_checkpoints  # noqa: E402

# checkpoint_save stores the weights under "train" -> "model"; DCP flattens the keys with dots.
PREFIX = "train.model."
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a checkpoint as model.safetensors + config.json.")
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a step-N folder (default: the newest complete one)")
    parser.add_argument("--checkpoints", type=Path, default=Path("outputs/checkpoints"),
                        help="where to look for the newest checkpoint (default: %(default)s)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("exported"), help="output folder (default: %(default)s)")
    args = parser.parse_args()
    checkpoint = args.checkpoint
    if checkpoint is None:
        complete = complete_checkpoints(args.checkpoints)
        if not complete:
            parser.error(f"no complete checkpoint (step-N folder) in {args.checkpoints}")
        checkpoint = complete[-1]
    if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
        # Never replace what is there: an earlier export may be the only copy of a model.
        parser.error(f"--output {args.output} exists and is not an empty folder; choose a new --output")
    try:
        model_config = json.loads((checkpoint / "checkpoint.json").read_text())["config"]["model"]
    except (OSError, ValueError, KeyError) as error:
        parser.exit(2, f"{checkpoint} is not a complete checkpoint ({error})\n")
    # Names and shapes the weights must have: the model built on the meta device, which allocates nothing.
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in Transformer(ModelArgs(**model_config)).state_dict().items()}

    args.output.mkdir(parents=True, exist_ok=True)
    target = args.output / "model.safetensors"
    partial = args.output / "model.safetensors.tmp"
    write_safetensors(checkpoint, expected, partial)
    partial.replace(target)
    (args.output / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    print(f"exported {checkpoint} -> {target} ({len(expected)} tensors) + {args.output / 'config.json'}")


def write_safetensors(checkpoint: Path, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    """Write the weights of a DCP checkpoint to `path`, tensor by tensor, so that only one is ever in memory.

    The safetensors format: an 8-byte little-endian header length, a JSON header giving each tensor's
    dtype, shape and byte range, then the raw little-endian bytes in that order.
    """
    reader = dcp.FileSystemReader(checkpoint)
    entries = {
        key.removeprefix(PREFIX): entry
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    check_names_and_shapes({name: tuple(entry.size) for name, entry in entries.items()}, expected, checkpoint)
    header, offset = {}, 0
    for name, entry in entries.items():
        size = entry.size.numel() * entry.properties.dtype.itemsize
        dtype = SAFETENSORS_DTYPES[entry.properties.dtype]
        header[name] = {"dtype": dtype, "shape": list(entry.size), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    # dcp.load without a process group warns that it assumes a single process, which is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, entry in entries.items():
            tensor = torch.empty(entry.size, dtype=entry.properties.dtype)
            # DCP assembles the full tensor from the shards that every rank wrote.
            dcp.load({PREFIX + name: tensor}, storage_reader=reader, no_dist=True)
            f.write(tensor.reshape(-1).view(torch.uint8).numpy())


def check_names_and_shapes(found: dict[str, tuple], expected: dict[str, tuple], checkpoint: Path) -> None:
    if found != expected:
        missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        reshaped = sorted(name for name in found.keys() & expected.keys() if found[name] != expected[name])
        sys.exit(
            f"{checkpoint} does not match the model in its checkpoint.json: missing {missing}, "
            f"unexpected {unexpected}, different shapes {reshaped}"
        )


if __name__ == "__main__":
    main()
