# ruff: noqa
"""FSDP009 through names: the bf16 dtype reaches reduce_dtype via a variable, not written in the call."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

LOW = torch.bfloat16
HALF = getattr(torch, "float16")


def build_policy() -> MixedPrecisionPolicy:
    low = torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)  # expect: FSDP009


def module_level_name() -> MixedPrecisionPolicy:
    # Not bound in this function: the module-level LOW.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=LOW)  # expect: FSDP009


def chained() -> MixedPrecisionPolicy:
    compute = LOW
    reduce = compute
    return MixedPrecisionPolicy(compute, reduce)  # expect: FSDP009


def via_getattr() -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=HALF)  # expect: FSDP009


def getattr_in_place() -> MixedPrecisionPolicy:
    dtype = getattr(torch, "bfloat16")
    none = None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=none)  # expect: FSDP009
