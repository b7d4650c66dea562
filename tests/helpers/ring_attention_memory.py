"""Peak memory of torch's ring attention (context parallelism) on this rank, for `fsdp2gen plan`'s ring row.

    torchrun --nproc-per-node CP tests/helpers/ring_attention_memory.py OUT.json '[[seq, heads, kv_heads, head_dim,
        "bfloat16"], ...]'

Runs torch's own _templated_ring_attention and _templated_ring_attention_backward (the code context_parallel runs
for the CUDA flash kernels, with its default all-gather rotation and load balancing) over gloo, with the attention
kernel replaced by a stub that returns its outputs' shapes (plan counts no kernel workspace), and records with
torch's MemTracker what each adds on top of its inputs (q, k, v, out, logsumexp, grad_out: the block's saved
activations). Rank 0 writes [{"forward": bytes, "backward": bytes}, ...], one per shape, to OUT.json.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _templated_ring_attention,
    _templated_ring_attention_backward,
)


def backward_kernel(query, key, value, out, logsumexp, is_causal, grad_out, **kwargs):
    return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


def forward_kernel(query, key, value, is_causal, **kwargs):
    return torch.zeros_like(query), torch.zeros(query.shape[:3])  # out, fp32 logsumexp


def measure(seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    group, cp = dist.group.WORLD, dist.get_world_size()
    local = seq // cp
    q = torch.randn(1, heads, local, head_dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, local, head_dim, dtype=dtype) for _ in range(2))
    out, grad_out, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(1, heads, local)
    runs = {
        "forward": lambda: _templated_ring_attention(group, 2, forward_kernel, q, k, v, is_causal=True),
        "backward": lambda: _templated_ring_attention_backward(
            group, 2, backward_kernel, grad_out, "grad_out", q, k, v, out, lse, is_causal=True
        ),
    }
    peaks = {}
    for name, run in runs.items():
        tracker = MemTracker()
        tracker.track_external(q, k, v, out, lse, grad_out)
        before = tracker.get_tracker_snapshot("current")[q.device]["Total"]
        with tracker:
            result = run()
            del result
        peaks[name] = tracker.get_tracker_snapshot("peak")[q.device]["Total"] - before
    return peaks


def main() -> None:
    gc.freeze()  # the imports outlive the probe: keep them out of the collector's full passes
    out_path, shapes = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    results = [measure(seq, heads, kv, dim, getattr(torch, dtype)) for seq, heads, kv, dim, dtype in shapes]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()  # every rank done before the group goes (gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
