# ruff: noqa
"""FSDP010: the process group is torn down without a barrier."""

import torch.distributed as dist
from torch.distributed import destroy_process_group as teardown


def main() -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(dist.get_rank())
    teardown()  # expect: FSDP010


def cleanup() -> None:
    dist.destroy_process_group()  # expect: FSDP010
