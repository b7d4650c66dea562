"""For a probe run under torchrun in a generated project (tests/helpers/*_probe.py): after its checks, in the same
launch, the training runs `torchrun train.py ARGS` would make, one after the other (a launch's ranks import torch,
and transformers, once). Each run is train.train() with its own config and mesh, as several_runs.py runs them."""

import json
import sys
from pathlib import Path


def take_option(args: list[str], option: str) -> tuple[list[list[str]], list[str]]:
    """The runs of `option RUNS.json` in `args` (RUNS.json: a list of train.py argument lists; none if `option` is
    not there), and the arguments without it."""
    if option not in args:
        return [], args
    at = args.index(option)
    return json.loads(Path(args[at + 1]).read_text()), args[:at] + args[at + 2 :]


def train_runs(runs: list[list[str]], device) -> int:
    """Each run in turn on every rank; the exit code of the first that stops (a usage error: 2), else 0."""
    import torch.distributed as dist
    import train
    from config import parse_args
    from layout import ParallelLayout

    sys.argv = ["train.py"]  # a run's messages name the script they come from, as from its own launch
    for args in runs:
        config = parse_args(args)
        dist.barrier()  # every rank has finished what came before
        if code := train.train(config, device, ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(
            device.type
        )):  # fmt: skip
            return code
    return 0
