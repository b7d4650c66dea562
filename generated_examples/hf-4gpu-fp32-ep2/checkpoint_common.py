"""What every checkpoint style shares at train time: the state a resume needs, the RNG states, publishing and
resuming step-N/ folders (their format, checkpoint.json and checks: checkpoint_files.py).

checkpoint.py saves and loads the tensors in this project's style; the folders around them work the same in
every style. A save writes step-N.tmp/ and publish() renames it to step-N/ once it is complete, so a crash
mid-save leaves only a .tmp folder, which resume ignores.

Every file of a checkpoint has its size and SHA-256 in checkpoint.json ("files"): the ranks hash the files they
wrote, and at resume each rank verifies its share of them. A corrupt checkpoint is never resumed from, nor
deleted: it is set aside as step-N.corrupt and the previous one is used. A save first checks that it fits on the
disk, and one that cannot be written stops every rank in one line, its step-N.tmp removed.

Measured on a 2-core CPU machine (files in the page cache): SHA-256 hashes 1.3 GB/s on an idle core (250-320 MB/s
with both cores busy). What it adds to a save and to a resume: ~1 ms for a 1.6 MB checkpoint; for a 240 MB one
(20M parameters, 2 ranks) ~0.09 s each with DCP (each rank hashes its 120 MB, in parallel) and, in the full style,
~0.18 s to a save (rank 0 hashes all of it) and ~0.12 s to a resume; those saves took 1.5-5 s in all.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from checkpoint_files import (
    checkpoint_bytes,
    complete_checkpoints,
    corrupt_file,
    load_checkpoint_info,
    newest_checkpoint,
    no_intact_checkpoint,
    short_of_space,
)
from config import Config, saved_config
from errors import reason, stop, stop_if_rank0_failed
from model_args import RESUME_MAY_CHANGE
from schema import as_option, resume_changes


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

    def progress(self) -> dict:
        """What a checkpoint saves besides the model, the optimizer and the RNG states, in every style."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "samples_seen": self.step * self.global_batch_size,
        }

    def restore_progress(self, saved: dict) -> None:
        """Continue from `saved` (what progress() returned, as a checkpoint holds it)."""
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step = saved["step"]

    def rng_state(self) -> dict:
        return rng_state(self.device)

    def restore_rng_state(self, saved: dict) -> None:
        set_rng_state(saved, self.device)


class CheckpointerBase:
    """What every checkpoint style's Checkpointer shares: its folder, the line checkpoint_save prints, and which
    step-N/ a resume loads. A style (checkpoint.py) defines save() and load_state(), and after_step() and close()
    when a save outlives save()."""

    # What checkpoint_save prints: the loop waited for the whole save.
    SAVE_LINE = "checkpoint step-{step} saved in {seconds:.2f} s"

    def __init__(self, checkpoint_dir: Path, config: Config) -> None:
        self.checkpoint_dir, self.config = checkpoint_dir, config

    def model_only_save(self, state: TrainState) -> bool:
        """Whether the save of `state` holds the model alone (checkpoint.model_only_final, at the last step). Stops
        every rank in one line, before anything is written, if the disk cannot hold it."""
        model_only = self.config.checkpoint.model_only_final and state.step == self.config.training.steps
        check_room(self.checkpoint_dir, state, model_only)
        return model_only

    def load(self, state: TrainState) -> Path | None:
        """Load the newest intact checkpoint into `state` and return its folder; None if there is none yet.

        A checkpoint whose tensors cannot be loaded into this model (weights that do not fit what its
        checkpoint.json claims) is unusable like a corrupt one: set aside, and the previous one is loaded."""
        unusable: list[tuple[Path, str]] = []
        while True:
            path, info = checkpoint_to_resume(self.checkpoint_dir, unusable)
            if path is None:
                return None
            if info["model_only"]:
                # The final checkpoint of a finished run (preflight.py made sure): nothing left to train.
                state.step = info["step"]
                return path
            problem = self.load_state(path, info, state)
            if problem is None:
                resumed_with(state, saved_config(info["config"]), self.config)
                return path
            unusable.append((path, problem))

    def load_state(self, path: Path, info: dict, state: TrainState) -> str | None:
        """Load the checkpoint `path` into `state`; None, or on every rank why its tensors cannot be loaded."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Nothing to do between saves: each save is complete when save() returns."""

    def close(self) -> None:
        """Nothing to release: no save outlives save()."""


def resumed_with(state: TrainState, saved: Config, config: Config) -> None:
    """After a resume: the keys a resume may change (schema.py) take this launch's values, and rank 0 names those
    that differ from the checkpoint's, in one line. The learning rate, the schedule's shape and the weight decay
    apply from the first step after the resume (the optimizer and scheduler states hold the saved values)."""
    training = config.training
    scheduler = state.scheduler
    scheduler.base_lrs = [training.lr for _ in scheduler.base_lrs]
    # The step's learning rate as LambdaLR.step() computes it, with this run's lr and schedule (train.py's
    # warmup_cosine reads the config). _last_lr: what get_last_lr() returns, the lr train_step logs.
    schedules = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    lrs = [base * schedule(scheduler.last_epoch) for base, schedule in schedules]
    for group, lr in zip(state.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
    state.optimizer.param_groups[0]["weight_decay"] = training.weight_decay  # build_optimizer's decayed group
    # (job.output_dir: where the run is, moved or not; not a setting of the run.) With the model's keys a resume may
    # change (model_args.py).
    changes = [change for change in resume_changes(saved, config, may_change=True) if change[0] != "job.output_dir"]
    changes += [change for change in resume_changes(saved, config, may_change=False)
                if change[0].removeprefix("model.") in RESUME_MAY_CHANGE]  # fmt: skip
    changed = [f"{key} {as_option(before)} -> {as_option(now)}" for key, before, now in changes]
    if changed and dist.get_rank() == 0:
        print(f"resume: this run changes {', '.join(changed)} (schema.py: a resume may change them)", flush=True)


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
    """Rank 0, once every rank's part of step-N.tmp/ is written: describe it, rename it, prune old ones.

    info["files"] holds the size and checksum of every file in it."""
    (staging / "checkpoint.json").write_text(json.dumps(info, indent=2) + "\n")
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    if final.exists():
        # A step-N/ of another save (a run resumed from an older checkpoint): kept beside, never deleted.
        final.rename(free_name(final, "replaced"))
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


def free_name(path: Path, label: str) -> Path:
    """step-N.<label>, or step-N.<label>-2, -3, ... if taken: a name that resume and pruning (step-N only) ignore."""
    candidate, number = path.with_name(f"{path.name}.{label}"), 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{label}-{number}")
    return candidate


def checkpoint_to_resume(
    checkpoint_dir: Path, unusable: list[tuple[Path, str]] | None = None
) -> tuple[Path | None, dict]:
    """The newest intact step-N/ and its checkpoint.json, on every rank as rank 0 found them.

    Rank 0 lists the folders and reads their checkpoint.json (through its schema: checkpoint_files.py), so that
    every rank loads the same folder even if the listing races a save; then every rank verifies its share of the
    files' checksums. A corrupt checkpoint, or one of `unusable` ((folder, why): those whose load failed), is
    passed over for the previous one and set aside (step-N.corrupt: never deleted, and no later save of step N
    replaces it); rank 0 says so in one line. None intact: every rank stops, in one line.
    """
    corrupt: list[tuple[Path, str]] = list(unusable or [])
    listed = [complete_checkpoints(checkpoint_dir)[::-1] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(listed, src=0)
    for path in [path for path in listed[0] if path not in {seen for seen, _ in corrupt}]:
        found: list = [{}, None]  # checkpoint.json, what is wrong with the folder
        if dist.get_rank() == 0:
            try:
                found[0] = load_checkpoint_info(path)
            except (OSError, ValueError) as exc:
                found[1] = reason(exc)
        dist.broadcast_object_list(found, src=0)
        info, problem = found
        if problem is None:
            problem = checksum_problem(path, info.get("files", {}))  # none recorded by older projects: nothing to do
        if problem is None:
            if corrupt:
                set_aside(corrupt, path)
            return path, info
        corrupt.append((path, problem))
    if corrupt:
        stop(no_intact_checkpoint(corrupt))
    return None, {}


def checksum_problem(path: Path, files: dict) -> str | None:
    """Every rank hashes its share of `files` (every world_size-th name from its rank: the number of ranks may
    differ from the save's), all in parallel. The first problem any rank found, on every rank."""
    names = sorted(files)[dist.get_rank() :: dist.get_world_size()]
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, corrupt_file(path, files, names))
    return next((problem for problem in problems if problem is not None), None)


def set_aside(corrupt: list[tuple[Path, str]], intact: Path) -> None:
    """Rank 0 renames the corrupt checkpoints newer than `intact` aside and says which one the run resumes from."""
    error = None
    if dist.get_rank() == 0:
        for path, problem in corrupt:
            try:
                aside = free_name(path, "corrupt")
                path.rename(aside)
            except OSError as exc:
                error = f"checkpoint {path} is corrupt ({problem}) and cannot be renamed aside ({exc})"
                break
            print(
                f"{Path(sys.argv[0]).name}: warning: checkpoint {path} is corrupt ({problem}); kept as {aside.name}, "
                f"resuming from {intact.name}",
                file=sys.stderr,
                flush=True,
            )
    stop_if_rank0_failed(error)


def check_room(checkpoint_dir: Path, state: TrainState, model_only: bool) -> None:
    """Before a save writes anything: stop every rank, in one line, unless the checkpoint fits on the disk."""
    # The parameters as the optimizer steps and a checkpoint saves them: sharded, in fp32. (Right after a forward
    # the model may hold some unsharded, in the compute dtype.) Then the frozen ones and the buffers.
    stepped = [param for group in state.optimizer.param_groups for param in group["params"]]
    frozen = [param for param in state.model.parameters() if not param.requires_grad]
    tensors = stepped + frozen + list(state.model.buffers())
    error = None
    if dist.get_rank() == 0:
        short = short_of_space(checkpoint_dir, checkpoint_bytes(tensors, model_only))
        if short is not None:
            error = f"disk full: checkpoint step-{state.step} {short}; {after_failed_save(checkpoint_dir, FREE_SPACE)}"
    stop_if_rank0_failed(error)


FREE_SPACE = "free space there (or lower --checkpoint.keep_last)"


def save_failed(staging: Path, exc: BaseException) -> str:
    """Rank 0, for a save that could not be written: remove step-N.tmp/ and return the one line that says why
    (a full disk, or what the OS said) and which checkpoint stays the newest."""
    shutil.rmtree(staging, ignore_errors=True)
    checkpoint_dir, name = staging.parent, staging.name.removesuffix(".tmp")
    cause = os_error_of(exc)
    code = cause.errno if cause is not None else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(checkpoint_dir).free / 2**20
        return (
            f"disk full: checkpoint {name} could not be written to {checkpoint_dir} ({os.strerror(code)}, "
            f"{free:.1f} MiB free); {after_failed_save(checkpoint_dir, FREE_SPACE)}"
        )
    why = reason(exc) if code is None else os.strerror(code)
    if code == errno.EFBIG:
        why += ": over the file size limit (ulimit -f) or the filesystem's largest file"
    return (
        f"checkpoint {name} could not be written to disk in {checkpoint_dir} ({why}); "
        f"{after_failed_save(checkpoint_dir, 'fix that')}"
    )


def after_failed_save(checkpoint_dir: Path, fix: str) -> str:
    newest = newest_checkpoint(checkpoint_dir)
    if newest is None:
        return f"no checkpoint was saved: {fix} and launch again"
    return f"{newest.name} stays the newest checkpoint: {fix} and launch again to resume from it"


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, its cause or context (torch.save's RuntimeError), or one of the failures
    a DCP CheckpointException gathered from the ranks; safetensors only names the code ("os error 28")."""
    seen: list[BaseException] = [exc]
    for current in seen:
        if len(seen) > 100:
            break  # a cycle of causes
        if isinstance(current, OSError) and current.errno:
            return current
        match = re.search(r"os error (\d+)", str(current))
        if match:
            return OSError(int(match[1]), os.strerror(int(match[1])))
        failures = getattr(current, "failures", None)  # dcp.CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            seen += [failure[0] for _, failure in sorted(failures.items())]
        seen += [cause for cause in (current.__cause__, current.__context__) if cause is not None]
    return None


def save_hf_checkpoint(model: nn.Module, hf_dir: Path, step: int, config: Config) -> None:
    """checkpoint.save_format = "hf", at each checkpoint, on every rank: the model as hf_dir/step-N/ (written as
    step-N.tmp/, renamed once complete), the newest checkpoint.keep_last of them kept. Resume never reads them:
    it reads the checkpoints' own folders, which this does not touch."""
    from model import save_hf_folder  # the family's names and files

    staging, final = hf_dir / f"step-{step}.tmp", hf_dir / f"step-{step}"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed save's leftover: never complete
    dist.barrier()
    save_hf_folder(model, staging, config)
    if dist.get_rank() == 0:
        if final.exists():  # a folder of another save (a run resumed from an older checkpoint): kept beside
            final.rename(free_name(final, "replaced"))
        staging.rename(final)
        saved = sorted((p for p in hf_dir.glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        for old in saved[: -config.checkpoint.keep_last]:
            shutil.rmtree(old)
    dist.barrier()
