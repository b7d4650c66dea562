"""Test-only (never in a generated project): lets torch's context parallelism run on CPU ranks.

torch's context_parallel() turns F.scaled_dot_product_attention into ring attention by handling the CUDA attention
kernels (flash, memory-efficient, cuDNN) of DTensors sharded along the sequence; the CPU kernel
(aten._scaled_dot_product_flash_attention_for_cpu and its backward) has no such handler, so CP stops on CPU with
"does not have a sharding strategy registered". This module adds one to the table context_parallel() installs
while it is active: it runs torch's own ring attention (_templated_ring_attention and its backward, the code the
CUDA handlers run) with the CPU kernel. Everything else (load balancing, buffer sharding, the monkey-patched
SDPA, the rotation, FSDP) is the GPU code path unchanged.

Put this folder on PYTHONPATH of a torchrun'd run: Python imports sitecustomize at start-up in every process.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # (batch, heads, seq, head_dim), as the CUDA handlers assume


def ring_cpu_flash_attention(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[DTensor, ...]:
    """The CP handler of the CPU flash-attention kernel, forward or backward: local shards in, ring attention over
    the cp group, shards along the sequence out (as torch's _sdpa_handler does for the CUDA kernels)."""
    names = [argument.name for argument in op_call._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    mesh = bound["query"].device_mesh
    bound = {name: value.to_local() if isinstance(value, DTensor) else value for name, value in bound.items()}
    if bound.pop("attn_mask", None) is not None:
        raise NotImplementedError("ring attention takes no attention mask (is_causal only)")
    group = mesh.get_group()
    if op_call is FORWARD:
        query, key, value, is_causal = bound.pop("query"), bound.pop("key"), bound.pop("value"), bound.pop("is_causal")
        outputs = _attention._templated_ring_attention(group, SEQ_DIM, FORWARD, query, key, value, is_causal, **bound)
    else:
        ring_backward = _attention._templated_ring_attention_backward
        outputs = ring_backward(group, SEQ_DIM, BACKWARD, grad_out_name="grad_out", **bound)
    return tuple(DTensor.from_local(output, mesh, [Shard(SEQ_DIM)], run_check=False) for output in outputs)


# context_parallel() installs this table's handlers on entry and removes them on exit.
_attention.custom_ops[FORWARD] = ring_cpu_flash_attention
_attention.custom_ops[BACKWARD] = ring_cpu_flash_attention
