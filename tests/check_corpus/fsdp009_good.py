# ruff: noqa
"""FSDP009 done right: compute in bf16, reduce in fp32."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
full = MixedPrecisionPolicy()


def policy_for(reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    # Not visible in the file: no finding.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
