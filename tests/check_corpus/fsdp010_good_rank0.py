# ruff: noqa
"""FSDP010 done right around rank conditions: every rank reaches a barrier before the teardown."""

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print("done")
    dist.barrier()
    dist.destroy_process_group()


def single_process_skips_it() -> None:
    # A condition on the world size, not on the rank: every rank takes the same branch.
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def both_branches(rank: int) -> None:
    if rank == 0:
        print("rank 0 writes first")
        dist.barrier()
    else:
        dist.barrier()
    dist.destroy_process_group()


def main_process_first(is_main_process: bool) -> None:
    # The "main process first" pattern: the other ranks wait, rank 0 works, then releases them.
    if not is_main_process:
        dist.barrier()
    print("download")
    if is_main_process:
        dist.barrier()
    dist.destroy_process_group()


def also_unconditional(rank: int) -> None:
    if rank != 0:
        dist.monitored_barrier()
    dist.barrier()
    dist.destroy_process_group()
