# ruff: noqa
"""FSDP006 stays silent when the caller (not in this file) finishes the job."""

import torch
from torch.distributed.fsdp import fully_shard

from mymodels import Transformer


def build_meta() -> Transformer:
    with torch.device("meta"):
        model = Transformer()
    fully_shard(model)
    return model


def shapes() -> dict:
    # A meta model used only to read shapes: nothing to materialise.
    with torch.device("meta"):
        probe = Transformer()
    return {name: p.shape for name, p in probe.named_parameters()}
