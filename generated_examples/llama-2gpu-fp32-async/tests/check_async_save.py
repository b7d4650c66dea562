"""Run under torchrun by test_checkpoint.py: background saves, checked from inside the ranks.

    torchrun ... tests/check_async_save.py [--section.key VALUE ...] [timing] [stager] [publish-fails]

Each check named (timing if none) runs in turn in the same processes, in a folder of its own: job.output_dir/<check>.

timing (the default): times, on the same state, a synchronous dcp.save; then Checkpointer.save (which starts a
background save and returns) and the training step that follows while that save is being written. Each rank
prints one line of numbers. A second background save (into the same staging buffers) follows, next to a second
synchronous one: each pair of checkpoints must hold the same state.

The disk is made slow on purpose (every rank's write takes SLOW_DISK_S longer, as on busy network
storage): on a CPU machine a training step can take longer than writing a small model to a local
disk, and the point to prove is that the step does not include the write, whatever the disk.

stager: runs train() itself, recording every DefaultStager its Checkpointer makes, what each save staged and when
the stager is closed, and whether the staged copies are pinned. One line per rank.

publish-fails: rank 0 cannot publish a background save (it cannot write its checkpoint.json). Checkpointer.after_step
(publish_if_done, which only rank 0 runs) must not raise; every rank must stop together at the next save, with one
line.
"""

import gc
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

import checkpoint as checkpoint_module
import train as train_module
from checkpoint import Checkpointer, DcpState, TrainState, staging_options
from data import ShuffledEpochs, SyntheticTokens, micro_batches
from train import build_model_meta, build_optimizer, run_on_every_rank, train_step

SLOW_DISK_S = 1.0


def slow_down_the_disk() -> None:
    write_data = dcp.FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(SLOW_DISK_S)
        return write_data(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow_write_data


def run_staging_options(config, device):
    """The staging options train()'s Checkpointer gives its stager."""
    return staging_options(device)


def say(line: str) -> None:
    # One write of one line: the ranks share stdout, and print() writes the text and its newline separately,
    # so another rank's line could land in between.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Run:
    """The model, optimizer and data of a short run, stepped by hand."""

    def __init__(self, config, device, mesh) -> None:
        self.config, self.device, training = config, device, config.training
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model = build_model_meta(config, mesh, device)
        self.optimizer, self.scheduler = build_optimizer(self.model, training, device)
        self.state = TrainState(
            self.model, self.optimizer, self.scheduler, training.global_batch_size, device, run_id="test"
        )
        self.samples = ShuffledEpochs(SyntheticTokens(config.model.vocab_size, training.seq_len, 64, training.seed), 0)

    def step(self) -> float:
        training = self.config.training
        started = time.perf_counter()
        batches = micro_batches(
            self.samples, self.state.step, training.global_batch_size, 1, self.rank, self.world_size
        )
        train_step(self.state, batches, self.config)
        self.state.step += 1
        return time.perf_counter() - started


def check_timing(config, device, mesh) -> None:
    run, rank = Run(config, device, mesh), dist.get_rank()
    output_dir = Path(config.job.output_dir)
    slow_down_the_disk()
    run.step()  # creates the optimizer state, so that both saves write everything a real save writes
    plain_step = run.step()
    dist.barrier()
    started = time.perf_counter()
    dcp.save({"train": DcpState(run.state)}, checkpoint_id=output_dir / "sync")
    sync_save = time.perf_counter() - started

    # As train() makes it: its own gloo group for the saves, one stager for the run.
    checkpointer = Checkpointer(output_dir / "checkpoints", config)
    dist.barrier()
    started = time.perf_counter()
    checkpointer.save(run.state)
    paused = time.perf_counter() - started
    step_during_save = run.step()
    # Only reported, never branched on: ranks may disagree about done().
    still_writing = not checkpointer.in_flight.future.done()
    checkpointer.in_flight.finish()
    whole_async_save = time.perf_counter() - started
    say(
        f"rank {rank}: sync save {sync_save:.3f} s | async save: paused {paused:.3f} s + step during the save "
        f"{step_during_save:.3f} s (plain step {plain_step:.3f} s, still writing after it: {still_writing}), "
        f"written after {whole_async_save:.3f} s"
    )
    # The next save copies into the buffers of the first: it must hold the state as it is now.
    dcp.save({"train": DcpState(run.state)}, checkpoint_id=output_dir / "sync-again")
    started = time.perf_counter()
    checkpointer.save(run.state)
    paused_again = time.perf_counter() - started
    run.step()
    checkpointer.close()
    say(f"rank {rank}: second async save into the same buffers: paused {paused_again:.3f} s")


def staged_buffers(staged: dict) -> dict[str, tuple[int, bool]]:
    """Where the staged copy of each model tensor lives (its CPU memory's address), and whether it is pinned."""
    buffers = {}
    for name, tensor in staged["train"]["model"].items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        buffers[name] = (local.untyped_storage().data_ptr(), local.is_pinned())
    return buffers


def check_stager(config, device, mesh) -> None:
    made, saves, closed = [], [], []

    class RecordingStager(DefaultStager):
        def __init__(self, options) -> None:
            super().__init__(options)
            made.append(options)

        def stage(self, state_dict, **kwargs):
            staged = super().stage(state_dict, **kwargs)
            saves.append((self, staged_buffers(staged)))
            return staged

        def close(self) -> None:
            closed.append(len(saves))
            super().close()

    checkpoint_module.DefaultStager = RecordingStager
    train_module.train(config, device, mesh)
    gc.collect()
    same_stager = all(stager is saves[0][0] for stager, _ in saves)
    same_buffers = all(buffers == saves[0][1] for _, buffers in saves)
    pinned = sorted({pinned for _, buffers in saves for _, pinned in buffers.values()})
    expected = run_staging_options(config, device)
    say(
        f"rank {dist.get_rank()}: {len(made)} stager(s), made with the options of staging_options: "
        f"{made == [expected]}; {len(saves)} saves, all by the same stager: {same_stager}, the model copied into "
        f"the same buffers each time: {same_buffers}, pinned: {pinned}; closed after saves {closed}"
    )


def check_publish_fails(config, device, mesh) -> None:
    run, rank = Run(config, device, mesh), dist.get_rank()
    checkpoint_dir = Path(config.job.output_dir) / "checkpoints"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(checkpoint_dir, config)
    run.step()
    checkpointer.save(run.state)
    if rank == 0:
        # A folder where publish writes checkpoint.json, which then fails.
        (checkpoint_dir / f"step-{run.state.step}.tmp" / "checkpoint.json").mkdir(parents=True)
        while not checkpointer.in_flight.future.done():
            time.sleep(0.01)
        # What the training loop does between saves (publish_if_done): it must neither raise nor wait for the
        # other ranks.
        checkpointer.after_step()
        say("rank 0: publish_if_done returned")
    run.step()  # training goes on: a collective of every rank
    # The next collective point of the save: every rank stops here with rank 0's error.
    checkpointer.save(run.state)
    say(f"rank {rank}: MISSED the stop")


CHECKS = {"timing": check_timing, "stager": check_stager, "publish-fails": check_publish_fails}


def main() -> None:
    # The checks' names may come anywhere among the overrides (runs.launch puts its own first).
    args = [arg for arg in sys.argv[1:] if arg not in CHECKS]
    names = [arg for arg in sys.argv[1:] if arg in CHECKS] or ["timing"]

    def run_checks(config, device, mesh) -> None:
        # Several checks in one launch: each rank's process starts (imports torch, joins the group) once for all.
        output_dir = Path(config.job.output_dir)
        for name in names:
            config.job.output_dir = str(output_dir / name)
            CHECKS[name](config, device, mesh)
            gc.collect()  # the check's model and optimizer, before the next builds its own

    # As train.py's main: publish-fails ends in stop() (so it comes last), and every rank must still leave the
    # process group (exiting with a live gloo group can abort the process instead of exiting with stop()'s code).
    run_on_every_rank(run_checks, args)


if __name__ == "__main__":
    main()
