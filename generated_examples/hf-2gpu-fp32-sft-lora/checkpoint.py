"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes and reads its own shards.

train.py's checkpoint_save and checkpoint_load call the Checkpointer; checkpoint_common.py holds what every
checkpoint style shares (the TrainState, the step-N/ folders, checkpoint.json, the RNG states).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as WriteFuture

from checkpoint_common import CheckpointerBase, TrainState, checkpoint_info, publish, save_failed
from checkpoint_files import file_record
from errors import reason, stop, stop_if_rank0_failed
from model import state_names

# LoRA checkpoints: the trainable adapters (and their optimizer state), not the frozen pretrained weights, which
# come from the pretrained files on every start. strict=False lets a load leave those frozen weights alone (DCP
# itself fails if the checkpoint lacks an adapter).
ADAPTERS_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


class DcpState(Stateful):
    """A TrainState as DCP saves and loads it: dcp.save/dcp.load call state_dict()/load_state_dict() on every rank."""

    def __init__(self, state: TrainState, with_rng: bool = True) -> None:
        # with_rng is False for a resume on other ranks than the checkpoint's: RNG streams belong to ranks.
        self.state, self.with_rng = state, with_rng

    def state_dict(self) -> dict:
        state = self.state
        # Sharded (DTensor) model and optimizer state: each rank writes only its own shards.
        # The adapters and their optimizer state only: the frozen base weights are the pretrained files'.
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer, options=ADAPTERS_ONLY)
        model_state = without_tied_frozen(state.model, model_state)
        saved = {"model": model_state, "optimizer": optimizer_state, **state.progress()}
        if self.with_rng:
            # One key per rank: DCP keeps a single copy of an entry that every rank saves under the same key.
            saved["rng"] = {f"rank{dist.get_rank()}": state.rng_state()}
        return saved

    def load_state_dict(self, saved: dict) -> None:
        state = self.state
        set_state_dict(
            state.model,
            state.optimizer,
            model_state_dict=saved["model"],
            optim_state_dict=saved["optimizer"],
            options=ADAPTERS_ONLY,
        )
        state.restore_progress(saved)
        if self.with_rng:
            state.restore_rng_state(saved["rng"][f"rank{dist.get_rank()}"])


def without_tied_frozen(model: nn.Module, model_state: dict) -> dict:
    """model_state without the frozen weights that ignore_frozen_params leaves in it (torch 2.13): it drops a frozen
    parameter under the one name named_parameters gives it, so a tied weight's other name stays (lm_head.weight,
    where the output layer shares the embedding's matrix): a whole frozen matrix in every checkpoint, which
    scripts/export.py would take for an adapter. Named as get_state_dict names them (model.state_names)."""
    frozen = {name for tensor, name in state_names(model) if not tensor.requires_grad}
    return {name: value for name, value in model_state.items() if name not in frozen}


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer, which also records the size and SHA-256 of every file (checkpoint.json's "files").

    Each rank hashes the files it wrote as soon as they are written, all ranks in parallel (with dcp-async, in the
    save's background thread); its records travel to rank 0 with its write results, which DCP gathers there for
    finish().
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.files: dict[str, dict] = {}  # every file's record, on rank 0 once the save is complete

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> WriteFuture[list[WriteResult]]:
        written = super().write_data(plan, planner)  # complete: FileSystemWriter writes before it returns
        results = written.wait()
        names = sorted({result.storage_data.relative_path for result in results})
        if results:
            # WriteResult is a frozen dataclass: the records ride on the first one as an extra attribute, which
            # pickles with it.
            object.__setattr__(results[0], "files", {name: file_record(self.path / name) for name in names})
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # writes .metadata, which is hashed too
        for rank_results in results:
            self.files |= getattr(rank_results[0], "files", {}) if rank_results else {}
        self.files[".metadata"] = file_record(self.path / ".metadata")


def abandon_save(staging: Path, exc: BaseException) -> None:
    """Every rank, once a save failed on all of them together: rank 0 removes step-N.tmp/ and says why, in one
    line; every rank stops."""
    stop(save_failed(staging, exc) if dist.get_rank() == 0 else "")


def start_staging(checkpoint_dir: Path, step: int) -> Path:
    """step-N.tmp/, once rank 0 has deleted what crashed saves left behind (no save is in flight now)."""
    if dist.get_rank() == 0:
        for leftover in checkpoint_dir.glob("step-*.tmp"):
            shutil.rmtree(leftover)
    dist.barrier()
    return checkpoint_dir / f"step-{step}.tmp"


class Checkpointer(CheckpointerBase):
    """Saves into and resumes from checkpoint_dir/step-N/, one sharded DCP checkpoint per save."""

    def save(self, state: TrainState) -> None:
        """Sharded DCP save into step-N.tmp/, renamed to step-N/ once every rank has finished writing.

        A crash mid-save leaves only a .tmp folder, which resume ignores.
        """
        config = self.config
        staging = start_staging(self.checkpoint_dir, state.step)
        model_only = self.model_only_save(state)
        if model_only:
            # model_only_final: the weights alone, under the same keys, for scripts/export.py or inference.
            app_state = {"train": {"model": get_model_state_dict(state.model, options=ADAPTERS_ONLY)}}
        else:
            app_state = {"train": DcpState(state)}
        info = checkpoint_info(state, config, model_only)
        # Every rank writes (and hashes) its own shards in parallel; dcp.save returns on every rank once all of
        # them and the .metadata (written last, by rank 0) are on disk.
        writer = ChecksummedWriter(staging)
        try:
            dcp.save(app_state, storage_writer=writer)
        except dcp.CheckpointException as exc:
            # DCP gathers every rank's write errors (a full disk, ...), so all ranks raise here together.
            abandon_save(staging, exc)
        error = None
        if dist.get_rank() == 0:
            try:
                publish(staging, info | {"files": writer.files}, config.checkpoint.keep_last)
            except OSError as exc:
                error = save_failed(staging, exc)
        stop_if_rank0_failed(error)

    def load_state(self, path: Path, info: dict, state: TrainState) -> str | None:
        """Load the checkpoint `path` into `state` (resharding if the world size changed); None, or why its tensors
        cannot be loaded (e.g. weights of another shape than this model's)."""
        # RNG streams belong to ranks: they continue only if the ranks are the same as when saved.
        same_ranks = info["world_size"] == dist.get_world_size() and info["device"] == state.device.type
        try:
            # DCP reads on every rank just the pieces of each tensor that the rank's shards need.
            dcp.load({"train": DcpState(state, with_rng=same_ranks)}, checkpoint_id=path)
        except dcp.CheckpointException as exc:
            # DCP gathers every rank's read and planning errors (a tensor of another shape than the model's), so
            # all ranks raise here together. Its exception wraps them (and is a BaseException): report the first.
            problem = reason(next(iter(exc.failures.values()))[0])
        except Exception as exc:  # on this rank only, maybe: the ranks agree below
            problem = reason(exc)
        else:
            problem = None
        problems: list = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        return next((found for found in problems if found is not None), None)
