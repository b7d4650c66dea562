# ruff: noqa
"""FSDP009 through names done right: fp32 reduction via a variable, and names whose value is not sure."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

LOW = torch.bfloat16
FULL = torch.float32


def build_policy() -> MixedPrecisionPolicy:
    low, full = torch.bfloat16, torch.float32
    reduce = full
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)


def module_level_name() -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=LOW, reduce_dtype=FULL)


def via_getattr(name: str) -> MixedPrecisionPolicy:
    # The dtype's name comes from the config: not visible in the file.
    return MixedPrecisionPolicy(param_dtype=LOW, reduce_dtype=getattr(torch, name))


def shadowed(LOW: torch.dtype) -> MixedPrecisionPolicy:
    # A parameter hides the module-level LOW.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=LOW)


def branches(exact: bool) -> MixedPrecisionPolicy:
    # Assigned two ways: the checker does not guess which branch runs.
    if exact:
        reduce = torch.bfloat16
    else:
        reduce = torch.float32
    return MixedPrecisionPolicy(param_dtype=LOW, reduce_dtype=reduce)


def looped() -> list[MixedPrecisionPolicy]:
    return [MixedPrecisionPolicy(param_dtype=LOW, reduce_dtype=dtype) for dtype in (torch.float32, FULL)]


def rebound_later() -> MixedPrecisionPolicy:
    reduce = torch.float32
    policy = MixedPrecisionPolicy(param_dtype=LOW, reduce_dtype=reduce)
    reduce = torch.bfloat16
    return policy
