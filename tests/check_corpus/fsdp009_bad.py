# ruff: noqa
"""FSDP009: gradients reduced in bf16/fp16."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as MP

bf16 = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)  # expect: FSDP009
fp16 = MP(torch.float16)  # expect: FSDP009
half = MP(torch.bfloat16, torch.half)  # expect: FSDP009
