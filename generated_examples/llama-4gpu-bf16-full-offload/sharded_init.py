"""Random initialisation of sharded parameters that gives the same values on any number of ranks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Row blocks of this many values at most are drawn at a time during initialisation.
INIT_BLOCK_ELEMENTS = 1 << 20


def fill_by_blocks(param: torch.Tensor, fill: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Fill the full tensor behind `param` block of rows by block of rows; keep this rank's part of each.

    The blocks depend only on the full shape, so every world size consumes the
    generator identically and gets the same values, without holding the full tensor.
    """
    if isinstance(param, DTensor):
        local = param.to_local()
        # Where this rank's shard sits in the full tensor, for any placement (FSDP, HSDP, TP). The helper is
        # private but is what DTensor itself uses; it has kept this signature since torch 2.4.
        local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        local, local_shape, offset = param, tuple(param.shape), (0,) * param.ndim
    rows, row_shape = param.shape[0], tuple(param.shape[1:])
    rows_per_block = max(1, INIT_BLOCK_ELEMENTS // max(1, math.prod(row_shape)))
    # This rank's columns (all dimensions but the first), e.g. under tensor parallelism.
    columns = tuple(slice(start, start + size) for start, size in zip(offset[1:], local_shape[1:], strict=True))
    for first in range(0, rows, rows_per_block):
        last = min(rows, first + rows_per_block)
        block = fill(torch.empty((last - first, *row_shape), dtype=param.dtype, device=local.device))
        low, high = max(first, offset[0]), min(last, offset[0] + local_shape[0])
        if low < high:
            local[low - offset[0] : high - offset[0]].copy_(block[(slice(low - first, high - first), *columns)])
