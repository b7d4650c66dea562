"""Several training runs of one generated project in one torchrun launch: each rank imports torch and joins the
process group once, then runs train.train() once per run, in order, each run with its own config and mesh.

    cd PROJECT && PYTHONPATH=. torchrun --nproc-per-node N several_runs.py RUNS.json

RUNS.json is a list of runs, each the argument list `train.py ARGS` would be given (its own --job.output_dir), or
{"args": ARGS, "interrupted": {"from": FOLDER, "remove": [PATHS], "metrics_lines": N, "flip": [FILES]}}: a
resume, whose output folder rank 0 first makes as an interrupted run leaves it: a copy of FOLDER (an earlier run's,
of this launch or not) without PATHS (the newer checkpoints), with the first N lines of its metrics.jsonl (all if N
is null or not given), and FILES (if given) damaged as silent disk corruption damages them: 64 bytes inverted in
the middle (flipped()). A
launch costs about 2 CPU-s for torchrun's agent and 3 per rank to import torch; a tiny run's training a fraction
of that. Each run is the run `torchrun train.py ARGS` makes: train() seeds every RNG from its config, builds its
model, optimizer, data and checkpointer afresh and closes them at its end; the mesh is that run's own layout
(built here as init_distributed builds it). Rank 0 prints "run N: ARGS" before each run, so that the output
tells the runs apart. Tests call launch_several().
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def launch_several(project: Path, runs: list, runs_file: Path, nproc: int) -> subprocess.CompletedProcess:
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
    # The project's messages name the script they come from (sys.argv[0]): each run speaks as train.py does.
    sys.argv = ["train.py"]

    def work(_config, device, _mesh) -> None:
        for index, run in enumerate(runs):
            args = run["args"] if isinstance(run, dict) else run
            config = parse_args(args)
            dist.barrier()  # every rank has finished the run before (its last files written)
            if dist.get_rank() == 0:
                print(f"run {index}: {' '.join(args)}", flush=True)
                if isinstance(run, dict):
                    interrupt(run["interrupted"], Path(config.job.output_dir))
            dist.barrier()  # the folder is ready on every rank
            mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
            train.train(config, device, mesh)

    # The first run's config joins the process group (job.device, timeout); every run builds its own mesh.
    first = runs[0]
    train.run_on_every_rank(work, first["args"] if isinstance(first, dict) else first)


def interrupt(interrupted: dict, output_dir: Path) -> None:
    """`output_dir` as a run stopped after its last kept checkpoint leaves it (see the module's docstring)."""
    shutil.copytree(interrupted["from"], output_dir)
    for path in interrupted["remove"]:
        shutil.rmtree(output_dir / path)
    if interrupted.get("metrics_lines") is not None:
        metrics = output_dir / "metrics.jsonl"
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[: interrupted["metrics_lines"]]))
    for path in interrupted.get("flip", []):
        (output_dir / path).write_bytes(flipped((output_dir / path).read_bytes()))


def flipped(data: bytes) -> bytes:
    """`data` with 64 bytes inverted in the middle (tensor data, past every header: a checkpoint file still parses
    and keeps its size)."""
    middle = len(data) // 2
    return data[:middle] + bytes(byte ^ 0xFF for byte in data[middle : middle + 64]) + data[middle + 64 :]


if __name__ == "__main__":
    main()
