# ruff: noqa
"""FSDP010 when the only barrier runs on some ranks: the others skip it and the ones waiting there hang."""

import os

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        print("done")
        dist.barrier()
    dist.destroy_process_group()  # expect: FSDP010


def finish() -> None:
    if dist.get_rank() == 0:
        dist.barrier()
    dist.destroy_process_group()  # expect: FSDP010


def finish_others(is_main: bool) -> None:
    if not is_main:
        dist.barrier()
    dist.destroy_process_group()  # expect: FSDP010


def finish_env() -> None:
    if int(os.environ["RANK"]) > 0:
        pass
    else:
        dist.barrier()
    dist.destroy_process_group()  # expect: FSDP010


def finish_both_on_rank0(local_rank: int) -> None:
    if local_rank == 0:
        dist.barrier()
        dist.destroy_process_group()  # expect: FSDP010
