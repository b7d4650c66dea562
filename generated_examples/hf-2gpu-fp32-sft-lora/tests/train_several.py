"""Run by runs.train_several: several training runs in one launch, one after another in the same processes.

Each run is the run `python train.py` (or torchrun) would make with the launch's arguments followed by its own
overrides, in job.output_dir/NAME: train.train() seeds every RNG from the run's config and builds its model,
optimizer, data and checkpoints afresh. TRAIN_RUNS (JSON) holds the runs: {NAME: [--section.key VALUE ...]}. A launch
costs seconds of CPU per rank (each imports torch and joins the process group); a tiny run's training a fraction of
that: here they are paid once for all the runs.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from config import parse_args
from layout import ParallelLayout
from train import run_on_every_rank, train


def main() -> None:
    launch_args = sys.argv[1:]
    runs = json.loads(os.environ["TRAIN_RUNS"])
    sys.argv[0] = "train.py"  # the runs' messages name the script they come from, as from their own launches

    def train_each(config, device, mesh) -> int | None:
        for name, overrides in runs.items():
            run = parse_args([*launch_args, *overrides, "--job.output_dir", str(Path(config.job.output_dir) / name)])
            # The run's own mesh, as init_distributed builds the launch's.
            run_mesh = ParallelLayout.of(run.parallel, dist.get_world_size()).build_mesh(device.type)
            if code := train(run, device, run_mesh):
                return code
        return None

    run_on_every_rank(train_each, launch_args)


if __name__ == "__main__":
    main()
