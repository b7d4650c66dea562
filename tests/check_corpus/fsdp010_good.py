# ruff: noqa
"""FSDP010 done right: every rank waits at a barrier first."""

import torch.distributed as dist
from torch.distributed import destroy_process_group as teardown


def main() -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(dist.get_rank())
    dist.barrier()
    teardown()


def cleanup() -> None:
    dist.monitored_barrier()
    dist.destroy_process_group()
