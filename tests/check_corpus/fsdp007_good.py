# ruff: noqa
"""FSDP007 done right: device from LOCAL_RANK first (or device_id=), or gloo on CPU."""

import os

import torch
import torch.distributed as dist


def init() -> torch.device:
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    return device


def init_with_device_id() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
