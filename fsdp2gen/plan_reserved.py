"""What a GPU holds beyond the step's live tensors at its peak: the CUDA caching allocator's rounding, its per-stream
pools and fragmentation, and NCCL's communication buffers. Each is a row of Plan.reserved_rows, named with its source;
Plan.reserved is the allocated peak plus all of them (the figure nvidia-smi shows, less the CUDA context).

The CPU simulation (a project's scripts/plan_memory.py) measures the first row only (it rounds each live tensor as the
allocator does): it has no CUDA streams, no allocator history over steps and no NCCL. tests/test_plan_simulation.py
compares plan with it on the allocated peak and on allocated + rounding; the other rows are arithmetic on the sources
named below, not measured here.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp2gen.plan_shapes import FP32, MIB

# The CUDA caching allocator (PyTorch's c10/core/AllocatorConfig.h and c10/cuda/CUDACachingAllocator.cpp, torch 2.13):
# every block is rounded up to 512 bytes (kMinBlockSize), requests of at most 1 MiB (kSmallSize) are carved from
# 2 MiB segments (kSmallBuffer), larger ones are rounded up to 2 MiB (kRoundLarge), those of 1 to 10 MiB
# (kMinLargeAlloc) carved from 20 MiB segments (kLargeBuffer), the rest given a segment of their own.
ROUND_LARGE = 2 * MIB
# What rounding adds at the peak, over the allocated bytes: the simulation rounds each live tensor at its peak as
# above and finds at most 1.005x over tests/test_plan_simulation.py's matrix; plan keeps 1.01x.
ROUNDING_RATIO = 1.01
# NCCL (src/init.cc): each channel of a connection holds a buffer per protocol and direction: DEFAULT_BUFFSIZE
# (1 << 22, 4 MiB, the NCCL_BUFFSIZE variable) for the Simple protocol that large messages use, and DEFAULT_LL_BUFFSIZE
# (8 lines x 512 threads x 8 steps x 16 bytes = 512 KiB) for the LL protocol of small ones (the loss's and the
# gradient norm's all-reduces). A ring connects each rank to 2 peers (it sends to one, receives from the other), on
# up to MAXCHANNELS = 32 channels (src/include/device.h; NCCL picks fewer on some topologies, NCCL_DEBUG=INFO prints
# how many): plan counts 32, an upper bound. NCCL allocates these with cudaMalloc, outside the caching allocator:
# torch.cuda.memory_reserved() does not show them, nvidia-smi does.
NCCL_SIMPLE_BUFFER = 4 * MIB
NCCL_LL_BUFFER = 512 * 1024
NCCL_CHANNELS = 32
NCCL_RING_PEERS = 2

# The rows, in the order the report prints them, with their source.
RESERVED_ROWS = {
    "allocator_rounding": "allocator rounding (512 B / 2 MiB blocks)",
    "allocator_stream_pools": "allocator: FSDP streams' cached buffers",
    "allocator_fragmentation": "allocator fragmentation (largest request)",
    "nccl_buffers": "NCCL buffers (outside the allocator)",
}


def round_large(nbytes: int) -> int:
    """`nbytes` as the allocator reserves a large request: rounded up to 2 MiB."""
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def communicators(request: Any) -> dict[str, int]:
    """The NCCL communicators a rank of `request` uses in a step, by mesh dimension, each with its ranks (only those of
    more than one rank exist): FSDP's shard group (dp_shard x cp), HSDP's replicate group (the gradient all-reduce),
    tensor, context and expert parallelism's groups, and the pipeline's send/receive to its neighbours."""
    groups = {
        "dp_shard": request.fsdp_ranks,
        "dp_replicate": request.dp_replicate,
        "tp": request.tp,
        "cp": request.cp,
        "ep": request.ep,
        "pp": request.pp,
    }
    return {name: ranks for name, ranks in groups.items() if ranks > 1 and request.world_size > 1}


def nccl_buffer_bytes(request: Any) -> int:
    """NCCL's buffers on one GPU: per communicator, channels x ring peers x (Simple + LL buffers). A single-rank run
    has none. (All-to-all and pipeline send/receive connect point to point; counted as a ring, their usual size.)"""
    per_communicator = NCCL_CHANNELS * NCCL_RING_PEERS * (NCCL_SIMPLE_BUFFER + NCCL_LL_BUFFER)
    return per_communicator * len(communicators(request))


def reserved_rows(
    request: Any, total: int, comm_buffers: int, comm_at_peak: int, largest_request: int
) -> dict[str, int]:
    """The rows of Plan.reserved_rows for a step whose peak is `total` allocated bytes.

    - allocator_rounding: every block rounded up (ROUNDING_RATIO, as the simulation measures it).
    - allocator_stream_pools: FSDP2 allocates its all-gather outputs on its all-gather stream and its reduce-scatter
      buffers on its reduce-scatter stream (torch.distributed.fsdp._fully_shard._fsdp_param_group: all_gather_stream,
      reduce_scatter_stream). The allocator caches a freed block for the stream that allocated it and serves no other
      stream's request from it (CUDACachingAllocator.cpp: blocks are associated with a stream); so at the peak, those
      of `comm_buffers` (the all-gather and reduce-scatter buffers, from the step before) that the peak's moment does
      not hold itself (`comm_at_peak`) are still reserved.
    - allocator_fragmentation: without expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the
      generated projects leave it off), segments never merge, and a cached segment split by smaller requests may hold
      no block that fits a large one, which then gets a new segment (PyTorch's devlog "When does fragmentation occur
      in the CUDA caching allocator?", 2026-06-01). Plan counts one more segment of the step's largest short-lived
      request (`largest_request`: a gathered block, its fp32 reduce-scatter input or a loss chunk's fp32 logits): an
      estimate, not a bound; many steps with varying shapes can fragment more.
    - nccl_buffers: nccl_buffer_bytes.
    """
    return {
        "allocator_rounding": math.ceil(total * ROUNDING_RATIO) - total,
        "allocator_stream_pools": max(0, comm_buffers - comm_at_peak),
        "allocator_fragmentation": round_large(largest_request),
        "nccl_buffers": nccl_buffer_bytes(request),
    }


def largest_request(per_gpu_block: int, loss_chunk: int, compute: int) -> int:
    """The step's largest short-lived allocation: a block's gathered parameters (compute dtype, one flat all-gather
    output), its fp32 reduce-scatter input, or a loss chunk's fp32 logits (`loss_chunk` bytes)."""
    return max(compute * per_gpu_block, FP32 * per_gpu_block, loss_chunk)
