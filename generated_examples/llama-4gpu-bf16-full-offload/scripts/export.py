"""Export a checkpoint as one safetensors file + config.json, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported

The weights then load into a plain, non-distributed model:

    model = Transformer(ModelArgs(**json.loads(Path("exported/config.json").read_text())))
    model.init_weights(seed=0)  # computes the rotary tables, which are not saved; the weights are replaced next
    model.load_state_dict(safetensors.torch.load_file("exported/model.safetensors"))

open_checkpoint, which reads the weights of any checkpoint style one tensor at a time, is scripts/generate.py's too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from model import ModelArgs, Transformer  # noqa: E402
from preflight import complete_checkpoints, corrupt_file  # noqa: E402

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class CheckpointError(Exception):
    """A step-N folder that cannot be read: not a complete checkpoint, or weight files that cannot be opened."""


class CheckpointMismatch(CheckpointError):
    """A step-N folder whose weights are not those of the model in its checkpoint.json."""


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
        config, weights, read = open_checkpoint(checkpoint)
    except CheckpointMismatch as error:
        sys.exit(str(error))
    except CheckpointError as error:
        parser.exit(2, f"{error}\n")

    args.output.mkdir(parents=True, exist_ok=True)
    target = args.output / "model.safetensors"
    partial = args.output / "model.safetensors.tmp"
    # The checkpoint already holds a safetensors file, checked against the model: copy it.
    shutil.copyfile(checkpoint / "model.safetensors", partial)
    partial.replace(target)
    (args.output / "config.json").write_text(json.dumps(config["model"], indent=2) + "\n")
    print(f"exported {checkpoint} -> {target} ({len(weights)} tensors) + {args.output / 'config.json'}")


def open_checkpoint(checkpoint: Path) -> tuple[dict, dict[str, tuple], Callable[[str], torch.Tensor]]:
    """The config of the run that wrote a step-N folder (its checkpoint.json), {name: (dtype, shape)} of the
    model's weights in it, and a function reading one weight as a whole CPU tensor, so that only one need be in
    memory at a time. Any checkpoint style.

    Raises CheckpointError, or CheckpointMismatch when the weights are not those of the model it names.
    """
    try:
        info = json.loads((checkpoint / "checkpoint.json").read_text())
        config = info["config"]
        model_config = config["model"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint ({error})") from None
    # Every file against the size and checksum recorded at save (checkpoints of older projects have none).
    files = info.get("files", {})
    problem = corrupt_file(checkpoint, files, sorted(files)) if isinstance(files, dict) else "files: not a table"
    if problem is not None:
        raise CheckpointError(f"{checkpoint} is corrupt ({problem}); export an older checkpoint")
    # Names and shapes the weights must have: the model built on the meta device, which allocates nothing.
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in Transformer(ModelArgs(**model_config)).state_dict().items()}
    try:
        found, read = checkpoint_tensors(checkpoint)
    except Exception as error:  # a missing or damaged file: each library raises its own kinds
        raise CheckpointError(f"{checkpoint}: its weights cannot be read ({type(error).__name__}: {error})") from None
    check_names_and_shapes({name: shape for name, (_, shape) in found.items()}, expected, checkpoint)
    return config, found, read


def checkpoint_tensors(checkpoint: Path) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor]]:
    """{name: (dtype, shape)} of the checkpoint's model.safetensors, and a function reading one tensor."""
    weights = safe_open(checkpoint / "model.safetensors", framework="pt")
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    found = {}
    for name in weights.keys():
        tensor_slice = weights.get_slice(name)
        found[name] = (dtypes[tensor_slice.get_dtype()], tuple(tensor_slice.get_shape()))
    return found, weights.get_tensor


def check_names_and_shapes(found: dict[str, tuple], expected: dict[str, tuple], checkpoint: Path) -> None:
    if found != expected:
        missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        reshaped = sorted(name for name in found.keys() & expected.keys() if found[name] != expected[name])
        raise CheckpointMismatch(
            f"{checkpoint} does not match the model in its checkpoint.json: missing {missing}, "
            f"unexpected {unexpected}, different shapes {reshaped}"
        )


if __name__ == "__main__":
    main()
