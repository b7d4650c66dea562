# ruff: noqa
"""FSDP007: no GPU pinned before the NCCL process group, or pinned by the global rank."""

import os

import torch
import torch.distributed as dist


def init() -> None:
    dist.init_process_group("nccl")  # expect: FSDP007


def init_multinode() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)  # expect: FSDP007
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(dist.get_rank())  # expect: FSDP007
