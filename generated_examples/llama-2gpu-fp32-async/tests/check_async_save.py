"""Run under torchrun by test_training.py: does a training step wait for a background save?

Times, on the same state: a synchronous dcp.save; then checkpoint_save (which starts a background save
and returns) and the training step that follows while that save is being written. Each rank prints
one line of numbers; the sync and async checkpoints must hold the same state.

The disk is made slow on purpose (every rank's write takes SLOW_DISK_S longer, as on busy network
storage): on a CPU machine a training step can take longer than writing a small model to a local
disk, and the point to prove is that the step does not include the write, whatever the disk.
"""

import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from config import parse_args
from data import ShuffledEpochs, SyntheticTokens, micro_batches
from train import TrainState, build_model_meta, build_optimizer, checkpoint_save, init_distributed, train_step

SLOW_DISK_S = 1.0


def slow_down_the_disk() -> None:
    write_data = dcp.FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(SLOW_DISK_S)
        return write_data(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow_write_data


def main() -> None:
    config = parse_args(sys.argv[1:])
    training = config.training
    device, mesh = init_distributed(config)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model_meta(config, mesh, device)
    optimizer, scheduler = build_optimizer(model, training, device)
    state = TrainState(model, optimizer, scheduler, training.global_batch_size, device, run_id="test")
    samples = ShuffledEpochs(SyntheticTokens(config.model.vocab_size, training.seq_len, 64, training.seed), 0)

    def step() -> float:
        started = time.perf_counter()
        batches = micro_batches(samples, state.step, training.global_batch_size, 1, rank, world_size)
        train_step(model, optimizer, scheduler, batches, training.max_norm, device)
        state.step += 1
        return time.perf_counter() - started

    output_dir = Path(config.job.output_dir)
    slow_down_the_disk()
    step()  # creates the optimizer state, so that both saves write everything a real save writes
    plain_step = step()
    dist.barrier()
    started = time.perf_counter()
    dcp.save({"train": state}, checkpoint_id=output_dir / "sync")
    sync_save = time.perf_counter() - started

    dist.barrier()
    save_group = dist.new_group(backend="gloo")
    started = time.perf_counter()
    in_flight = checkpoint_save(state, output_dir / "checkpoints", config, None, save_group)
    paused = time.perf_counter() - started
    step_during_save = step()
    # Only reported, never branched on: ranks may disagree about done().
    still_writing = not in_flight.future.done()
    in_flight.finish()
    whole_async_save = time.perf_counter() - started
    # One write of one line: the ranks share stdout, and print() writes the text and its newline separately,
    # so another rank's line could land in between.
    sys.stdout.write(
        f"rank {rank}: sync save {sync_save:.3f} s | async save: paused {paused:.3f} s + step during the save "
        f"{step_during_save:.3f} s (plain step {plain_step:.3f} s, still writing after it: {still_writing}), "
        f"written after {whole_async_save:.3f} s\n"
    )
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
