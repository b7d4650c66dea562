"""Export a checkpoint as one safetensors file + config.json, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported

The weights then load into a plain, non-distributed model:

    model = Model(ModelArgs(**json.loads(Path("exported/config.json").read_text())))
    model.init_weights(seed=0)  # fills the buffers the model computes (rotary tables); then the weights
    model.load_state_dict(safetensors.torch.load_file("exported/model.safetensors"))

open_checkpoint (checkpoint_reader.py) reads the weights of any checkpoint style one tensor at a time, as for
scripts/generate.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from checkpoint_files import complete_checkpoints  # noqa: E402
from checkpoint_reader import CheckpointError, CheckpointMismatch, open_checkpoint, write_safetensors  # noqa: E402


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
    write_safetensors(partial, weights, read)
    partial.replace(target)
    (args.output / "config.json").write_text(json.dumps(config["model"], indent=2) + "\n")
    print(f"exported {checkpoint} -> {target} ({len(weights)} tensors) + {args.output / 'config.json'}")


if __name__ == "__main__":
    main()
