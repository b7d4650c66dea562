"""Run under torchrun inside a generated project (PYTHONPATH = the project) by test_no_host_sync_in_step.py.

Counts, per training step and per rank, the calls that copy a tensor's value to the host: on a GPU each one waits
for the device's queue to drain (a host sync). Tensor.item/tolist/cpu/numpy and a tensor's __bool__/__float__/
__int__ are wrapped before train.train runs; a call belongs to the step whose train_step last started (so a
step's count includes its metrics.log, validation and checkpoint). On CPU ranks nothing really waits, but the same
calls are made as on a GPU: counting them is what a GPU's sync debug mode would report for the project's code.
Each rank writes $PROBE_OUT/rank<N>.json: {"steps": [count of step 1, ...], "sites": {step: [call, ...]}}, a call
written "item file:line function".

    sync_probe.py --runs RUNS.json    (torchrun, in the first run's project; test_no_host_sync_in_step.py)

counts several runs in one launch (each rank imports torch and joins the process group once): RUNS.json is a list
of {"project": FOLDER, "args": [train.py ARGS], "out": FOLDER}; each run is FOLDER's train.train() with its own
config and mesh (tests/helpers/several_runs.py swaps the projects' modules), its counts written to its "out".
"""

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import train
from config import parse_args

WRAPPED = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
counts: list[int] = []  # one entry per step begun
sites: dict[int, list[str]] = {}


TORCH = Path(torch.__file__).parent


def caller() -> str:
    """The innermost frame outside this file, where the sync was asked for: torch/<path>:line inside torch (e.g.
    torch/optim/optimizer.py), else the file's name (train.py, metrics.py), then the function's name."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if path != Path(__file__) and path.name != "warnings.py":
            where = f"torch/{path.relative_to(TORCH)}" if path.is_relative_to(TORCH) else path.name
            return f"{where}:{frame.lineno} {frame.name}"
    return "?"


def counting(name: str):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        # Only what the training loop asks for: before the first step (building, loading) nothing is counted.
        if counts:
            counts[-1] += 1
            sites.setdefault(len(counts), []).append(f"{name} {caller()}")
        return original(self, *args, **kwargs)

    return wrapper


def counted(train) -> None:
    """Count from each train_step that begins in the `train` module on."""
    original_train_step = train.train_step

    def counted_train_step(*args, **kwargs):
        counts.append(0)
        return original_train_step(*args, **kwargs)

    train.train_step = counted_train_step


def write_counts(out: str) -> None:
    """This rank's counts of the run just trained into `out`; counting stops until the next step begins."""
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"steps": list(counts), "sites": sites}))
    counts.clear()
    sites.clear()


def several(runs_file: str) -> None:
    """Each run of RUNS.json in turn (see the module's docstring), in this one process group."""
    import importlib

    from several_runs import use_project

    runs = json.loads(Path(runs_file).read_text())
    sys.argv = ["train.py"]  # the project's messages name the script they come from
    device, _ = train.init_distributed(parse_args(runs[0]["args"]))
    for run in runs:
        use_project(Path(run["project"]).resolve())
        project_train = importlib.import_module("train")
        config = importlib.import_module("config").parse_args(run["args"])
        layout = importlib.import_module("layout").ParallelLayout
        mesh = layout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
        counted(project_train)
        project_train.train(config, device, mesh)
        write_counts(run["out"])
        dist.barrier()  # every rank has finished the run (its last files written) before the next
    importlib.import_module("train").close_process_group()


for name in WRAPPED:
    setattr(torch.Tensor, name, counting(name))
if sys.argv[1:2] == ["--runs"]:
    several(sys.argv[2])
    sys.exit(0)
counted(train)
config = parse_args(sys.argv[1:])
device, mesh = train.init_distributed(config)
if device.type == "cuda":
    # On a GPU, CUDA's own count as well (scripts/gpu_smoke.sh): every operation that waits for the device warns,
    # whatever asked for it; such calls are written "cuda file:line function".
    torch.cuda.set_sync_debug_mode("warn")
    warnings.simplefilter("always")
    show = warnings.showwarning

    def count_cuda_syncs(message, category, *args, **kwargs):
        if "synchronizing CUDA operation" not in str(message) or not counts:
            return show(message, category, *args, **kwargs)
        counts[-1] += 1
        sites.setdefault(len(counts), []).append(f"cuda {caller()}")

    warnings.showwarning = count_cuda_syncs
train.train(config, device, mesh)
write_counts(os.environ["PROBE_OUT"])
train.close_process_group()
