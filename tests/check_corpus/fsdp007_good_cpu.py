# ruff: noqa
"""FSDP007 does not apply to gloo on CPU."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
