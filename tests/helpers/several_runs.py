"""Several training runs of one generated project in one torchrun launch: each rank imports torch and joins the
process group once, then runs train.train() once per run, in order, each run with its own config and mesh.

    cd PROJECT && PYTHONPATH=. torchrun --nproc-per-node N several_runs.py RUNS.json

RUNS.json is a list of argument lists, each what `train.py ARGS` would be given (its own --job.output_dir). A
launch costs about 2 CPU-s for torchrun's agent and 3 per rank to import torch; a tiny run's training a fraction
of that. Each run is the run `torchrun train.py ARGS` makes: train() seeds every RNG from its config, builds its
model, optimizer, data and checkpointer afresh and closes them at its end; the mesh is that run's own layout
(built here as init_distributed builds it). Rank 0 prints "run N: ARGS" before each run, so that the output
tells the runs apart. Tests call launch_several().
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def launch_several(project: Path, runs: list[list[str]], runs_file: Path, nproc: int) -> subprocess.CompletedProcess:
    """The runs (train.py's argument lists) in one launch of `nproc` gloo ranks in `project` (1: a plain process,
    a group of one, as `python train.py` runs), the list written to `runs_file`; fails the test with the output's
    tail unless every run succeeds."""
    from tests.conftest import torchrun, torchrun_env

    runs_file.write_text(json.dumps(runs))
    if nproc > 1:
        return torchrun(project, __file__, str(runs_file), nproc=nproc)
    result = subprocess.run([sys.executable, __file__, str(runs_file)], cwd=project, capture_output=True, text=True,
                            env={**torchrun_env(), "PYTHONPATH": str(project)}, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def main() -> None:
    import torch.distributed as dist
    import train
    from config import parse_args
    from layout import ParallelLayout

    with open(sys.argv[1]) as file:
        runs = json.load(file)

    def work(_config, device, _mesh) -> None:
        for index, args in enumerate(runs):
            if dist.get_rank() == 0:
                print(f"run {index}: {' '.join(args)}", flush=True)
            config = parse_args(args)
            mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
            train.train(config, device, mesh)

    # The first run's config joins the process group (job.device, timeout); every run builds its own mesh.
    train.run_on_every_rank(work, runs[0])


if __name__ == "__main__":
    main()
