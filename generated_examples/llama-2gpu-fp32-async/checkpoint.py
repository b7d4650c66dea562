"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written in the background while training goes on.

train.py's checkpoint_save and checkpoint_load call the Checkpointer; checkpoint_common.py holds what every
checkpoint style shares (the TrainState, the step-N/ folders, checkpoint.json, the RNG states).
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as WriteFuture

from checkpoint_common import CheckpointerBase, TrainState, checkpoint_info, publish, save_failed, save_hf_checkpoint
from checkpoint_files import file_record
from config import Config
from errors import reason, stop, stop_if_rank0_failed


class DcpState(Stateful):
    """A TrainState as DCP saves and loads it: dcp.save/dcp.load call state_dict()/load_state_dict() on every rank."""

    def __init__(self, state: TrainState, with_rng: bool = True) -> None:
        # with_rng is False for a resume on other ranks than the checkpoint's: RNG streams belong to ranks.
        self.state, self.with_rng = state, with_rng

    def state_dict(self) -> dict:
        state = self.state
        # Sharded (DTensor) model and optimizer state: each rank writes only its own shards.
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
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
        )
        state.restore_progress(saved)
        if self.with_rng:
            state.restore_rng_state(saved["rng"][f"rank{dist.get_rank()}"])


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
    """Saves into and resumes from checkpoint_dir/step-N/, each save written in the background.

    Made once per run, on every rank: background saves run their collectives on a gloo group of their own,
    never on the training group, and copy the state into the CPU buffers of one stager for the whole run.
    """

    # What checkpoint_save prints: the loop waited only for the save to start (the copy into CPU memory).
    SAVE_LINE = "checkpoint step-{step} started: training paused {seconds:.2f} s"

    def __init__(self, checkpoint_dir: Path, config: Config) -> None:
        super().__init__(checkpoint_dir, config)
        # Background saves run their collectives on this gloo group, never on the training group.
        self.group = dist.new_group(backend="gloo")
        # One stager for the whole run, made by the first save (which knows the state's device): every save copies
        # into the same CPU buffers (see staging_options).
        self.stager: DefaultStager | None = None
        self.in_flight: BackgroundSave | None = None

    def save(self, state: TrainState) -> None:
        """Start a sharded DCP save into step-N.tmp/ and return while it is written in the background.

        The step waits only while the state is copied into the stager's CPU buffers; a thread writes the copy.
        At most one save is in flight: the previous one is finished (on every rank) first, which also makes the
        buffers free to reuse. A crash mid-save leaves only a .tmp folder, which resume ignores.
        """
        if self.in_flight is not None:
            self.in_flight.finish()
        config = self.config
        staging = start_staging(self.checkpoint_dir, state.step)
        model_only = self.model_only_save(state)
        if model_only:
            # model_only_final: the weights alone, under the same keys, for scripts/export.py or inference.
            app_state = {"train": {"model": get_model_state_dict(state.model)}}
        else:
            app_state = {"train": DcpState(state)}
        info = checkpoint_info(state, config, model_only)
        # A gloo group of its own: the writer thread runs the save's collectives while the training loop runs
        # its own on the default group, and the two must never interleave on one group.
        if self.stager is None:
            self.stager = DefaultStager(staging_options(state.device))
        writer = ChecksummedWriter(staging)
        future = dcp.async_save(app_state, storage_writer=writer, process_group=self.group, async_stager=self.stager)
        self.in_flight = BackgroundSave(future, writer, info, config.checkpoint.keep_last, self.stager)
        if config.checkpoint.save_format == "hf":  # also a Hugging Face folder, outside step-N/
            save_hf_checkpoint(state.model, self.checkpoint_dir.parent / "hf", state.step, config)

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

    def after_step(self) -> None:
        """Between saves: rank 0 publishes the save in flight as soon as it is complete (see publish_if_done)."""
        if self.in_flight is not None:
            self.in_flight.publish_if_done()

    def close(self) -> None:
        """At the end of the run, on every rank: finish the save in flight, then free the staging buffers."""
        if self.in_flight is not None:
            # Exiting now would leave the last checkpoint half written (an empty folder): wait on every rank.
            self.in_flight.finish()
        # Frees the staging buffers (and unpins them) now, not when the process ends.
        if self.stager is not None:
            self.stager.close()


def staging_options(device: torch.device, cpu_offload: bool = False) -> StagingOptions:
    """How the run's one DefaultStager copies the state out of the training tensors at each save.

    Without a stager of its own, dcp.async_save copies every save into newly allocated, pageable CPU memory.
    A DefaultStager keeps its CPU copy of each tensor from one save to the next and copies into it again.
    - Pinned (page-locked) buffers when the state lives on a GPU: device-to-host copies into them run at full
      PCIe/NVLink-C2C speed and without blocking (then one synchronize), so the loop waits less. Pinning
      needs CUDA, and it only helps copies from the device: on CPU, and with CPU offload (the shards and
      AdamW's moments already live in host memory), plain memory. The buffers hold this rank's whole
      state (about 12 bytes per parameter / ranks with AdamW in fp32) for the whole run, pinned on a GPU.
    - No shared memory: only the process-based checkpointer (another process) needs it; saves here run
      in a thread.
    - No background staging: the copy is done when Checkpointer.save returns, so the optimizer may change
      the parameters right away. (Staging in a thread would need a wait before the next optimizer step.)
    """
    from_gpu = device.type == "cuda" and not cpu_offload
    return StagingOptions(
        use_pinned_memory=from_gpu,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=from_gpu,
    )


class BackgroundSave:
    """The one dcp.async_save in flight, and its publication as step-N/ once it is complete."""

    def __init__(
        self, future: Future, writer: ChecksummedWriter, info: dict, keep_last: int, stager: DefaultStager
    ) -> None:
        # The writer writes step-N.tmp/ (its path) and has the files' checksums once the save is complete.
        self.future, self.writer, self.staging, self.info = future, writer, writer.path, info
        self.keep_last, self.stager = keep_last, stager
        self.published = False
        self.error: str | None = None  # rank 0's failure to publish, reported by finish() on every rank

    def publish_if_done(self) -> None:
        """Rank 0 publishes the save as soon as it is complete, so that a crash soon after resumes from it.

        Rank 0 coordinates the save: its future completes only after every rank's files and the .metadata
        are written. Ranks may disagree about future.done(), so only rank 0 looks, and nothing here is a
        collective. Nor does it raise: rank 0 stopping alone would leave the others waiting for it in their
        next collective. A failure is kept, and finish() stops every rank with it.
        """
        if dist.get_rank() != 0 or self.published or self.error is not None:
            return
        if self.future.done() and self.future.exception() is None:
            try:
                publish(self.staging, self.info | {"files": self.writer.files}, self.keep_last)
                self.published = True
            except OSError as exc:
                self.error = save_failed(self.staging, exc)

    def finish(self) -> None:
        """Wait for the save on every rank, then publish it (if publish_if_done has not yet).

        If it failed, every rank stops here together, after closing the stager (its buffers go with it).
        """
        try:
            try:
                # result() on every rank: each waits for its own writes, and all raise if any rank failed.
                self.future.result()
            except dcp.CheckpointException as exc:
                abandon_save(self.staging, exc)
            if dist.get_rank() == 0 and not self.published and self.error is None:
                try:
                    publish(self.staging, self.info | {"files": self.writer.files}, self.keep_last)
                except OSError as exc:
                    self.error = save_failed(self.staging, exc)
            self.published = self.error is None
            stop_if_rank0_failed(self.error)
        except BaseException:
            self.stager.close()
            raise
