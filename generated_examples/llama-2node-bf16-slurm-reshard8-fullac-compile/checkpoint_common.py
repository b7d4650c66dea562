"""What every checkpoint style shares: the step-N/ folders and their checkpoint.json, and the RNG states.

checkpoint.py saves and loads the tensors in this project's style; the folders around them work the same in
every style. A save writes step-N.tmp/ and publish() renames it to step-N/ once it is complete, so a crash
mid-save leaves only a .tmp folder, which resume ignores.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from config import Config
from errors import stop
from preflight import PreflightError, complete_checkpoints, newest_checkpoint, read_checkpoint_info


@dataclass(eq=False)
class TrainState:
    """Everything a resume needs, in every checkpoint style."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    global_batch_size: int
    device: torch.device
    run_id: str
    # Optimizer steps taken. data.py addresses samples by global index, so the data position is
    # step x global_batch_size samples whatever the number of ranks: no loader state to save.
    step: int = 0


def rng_state(device: torch.device) -> dict:
    """This rank's random number generators: torch (and CUDA), numpy, python. As tensors and plain values
    only: checkpoints are read back with torch.load(weights_only=True), which refuses numpy arrays."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": numpy_state["state"]["pos"],
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        },
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def seed_everything(seed: int) -> None:
    """Start torch's (CPU and every GPU's), numpy's and python's random number generators from `seed`.

    Every run, pretrained or not, and alike on every rank (the ranks of a tensor-parallel group must draw the
    same dropout masks): dropout and any other random op repeat from run to run. A resume then restores each
    rank's saved states, which continue the interrupted run's streams exactly.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CUDA generators of every device too


def set_rng_state(state: dict, device: torch.device) -> None:
    numpy_state = state["numpy"]
    key = numpy_state["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"]))
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def checkpoint_info(state: TrainState, config: Config, model_only: bool) -> dict:
    """checkpoint.json: what resume checks before loading any tensor, and what scripts/export.py reads."""
    return {
        "step": state.step,
        "world_size": dist.get_world_size(),
        "device": state.device.type,
        "model_only": model_only,
        "run_id": state.run_id,
        "config": asdict(config),
    }


def publish(staging: Path, info: dict, keep_last: int) -> None:
    """Rank 0, once every rank's part of step-N.tmp/ is written: describe it, rename it, prune old ones."""
    (staging / "checkpoint.json").write_text(json.dumps(info, indent=2) + "\n")
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    shutil.rmtree(final, ignore_errors=True)
    # The rename is atomic: step-N/ appears complete or not at all. (Every file in it is named relative to
    # the folder, DCP's .metadata included, so renaming it is safe.)
    staging.rename(final)
    # Older checkpoints of this run go only now that a newer one is complete. Never another run's: one copied
    # in by hand is left alone (and resume refuses it).
    ours = [p for p in complete_checkpoints(staging.parent) if run_id_of_checkpoint(p) in (info["run_id"], None)]
    for old in ours[:-keep_last]:
        shutil.rmtree(old)


def run_id_of_checkpoint(path: Path) -> str | None:
    try:
        return json.loads((path / "checkpoint.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return "unknown"  # unreadable: not provably this run's, so never pruned


def checkpoint_to_resume(checkpoint_dir: Path) -> tuple[Path | None, dict]:
    """The newest complete step-N/ and its checkpoint.json, on every rank as rank 0 found them.

    Rank 0 decides, so that every rank loads the same folder even if the listing races a save.
    """
    found: list = [None, {}, None]  # folder, checkpoint.json, error
    if dist.get_rank() == 0:
        found[0] = newest_checkpoint(checkpoint_dir)
        try:
            found[1] = read_checkpoint_info(found[0]) if found[0] is not None else {}
        except PreflightError as exc:
            found[2] = str(exc)
    dist.broadcast_object_list(found, src=0)
    if found[2] is not None:
        stop(found[2])
    return found[0], found[1]
