"""Context parallelism for the llama model (parallel.cp > 1): every sequence is split over the cp ranks of its
group, so a rank holds the activations of seq_len / cp tokens, and attention passes keys and values around the
group (ring attention, torch.distributed.tensor.experimental.context_parallel, as torchtitan does).

- Load balancing: each sequence is cut in 2 x cp pieces and rank r holds pieces r and 2 x cp - 1 - r, one early
  and one late, so every rank does the same share of the causal attention (layout.py checked that seq_len divides
  into 2 x cp x tp pieces: torch silently falls back to unbalanced pieces otherwise). A rank's tokens are then not
  consecutive: `positions` says where each one sits, and model.py indexes its rotary tables with it.
- Loss: a rank's loss is the mean over its own tokens, and every rank holds equally many tokens of every sample,
  so the mean of the cp ranks' losses is the mean over the whole sequence; FSDP averages the gradients over
  dp_shard x cp (layout.fsdp_mesh), which makes them the gradient of that mean.
- Rotation: "allgather" (torch's default, and torchtitan's): after attending to its own keys and values, a rank
  all-gathers the rest of the group's in one collective, which overlaps that first block's compute. It holds
  the whole sequence's keys and values for one attention at a time (small next to the activations with grouped
  query attention: n_kv_heads x head_dim per token). "alltoall" passes them rank to rank instead (less memory,
  cp - 1 exchanges). Backward always passes gradients rank to rank.
- Attention: context_parallel replaces F.scaled_dot_product_attention while it is active, so model.py must look
  it up at call time (it does: F.scaled_dot_product_attention) with is_causal=True and no mask, and only the
  flash, memory-efficient and cuDNN kernels (CUDA) can be split (preflight.py checks one is enabled).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops, set_rotate_method

from data import MicroBatch
from layout import ParallelLayout

# The sequence dimension of inputs, targets and positions (batch, seq).
SEQ_DIM = 1
# The model's attention compute dtype, by the project's precision (fp32: no mixed precision).
COMPUTE_DTYPE = torch.bfloat16


class ContextParallelError(ValueError):
    """What context parallelism cannot run with: the message is one line naming it and the fix."""


def check_context_parallel(config: Any, world_size: int, device_type: str) -> None:
    """Raise ContextParallelError for a setting parallel.cp > 1 cannot run with on `world_size` ranks (preflight.py,
    before any model is built). One process (`python train.py`) has no cp groups: nothing to check."""
    cp = ParallelLayout.of(config.parallel, world_size).cp
    if cp == 1:
        return
    if config.data.document_mask:
        raise ContextParallelError(
            f"parallel.cp = {cp} cannot mask documents (ring attention is causal over the whole sequence); run "
            "with --data.document_mask false, or --parallel.cp 1 to keep documents apart"
        )
    if not any(op.name() in SPLIT_KERNELS[device_type] for op in custom_ops):
        raise ContextParallelError(
            f"parallel.cp = {cp} needs CUDA GPUs: torch's ring attention has no {device_type.upper()} attention "
            f"kernel; run with --parallel.cp 1 on {device_type.upper()}"
        )
    if device_type == "cuda":
        check_cuda_attention(config.model.n_heads, config.model.n_kv_heads, config.model.head_dim, cp)


# The attention kernels torch's context parallelism splits over the cp ranks, by device: its custom_ops table
# (private) has a ring-attention handler for the CUDA ones only.
SPLIT_KERNELS = {
    "cuda": {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
    },
    "cpu": {"aten::_scaled_dot_product_flash_attention_for_cpu"},
}


def check_cuda_attention(heads: int, kv_heads: int, head_dim: int, cp: int) -> None:
    """One of the kernels ring attention splits (flash, memory-efficient, cuDNN) must be enabled and able to run
    this model's attention: with only the math kernel left, context parallelism stops at the first forward."""
    # The shapes and dtype of model.py's call (a few tokens stand for any length): causal, no mask, grouped heads.
    query = torch.empty(1, heads, 64, head_dim, dtype=COMPUTE_DTYPE, device="cuda")
    key = torch.empty(1, kv_heads, 64, head_dim, dtype=COMPUTE_DTYPE, device="cuda")
    params = torch.backends.cuda.SDPAParams(query, key, key, None, 0.0, True, True)  # ..., dropout, causal, gqa
    usable = [
        name
        for name, enabled, can_use in (
            ("flash", torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.can_use_flash_attention),
            ("memory-efficient", torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.backends.cuda.can_use_efficient_attention),
            ("cuDNN", torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.can_use_cudnn_attention),
        )
        if enabled and can_use(params, False)
    ]  # fmt: skip
    if not usable:
        raise ContextParallelError(
            f"parallel.cp = {cp} needs the flash, memory-efficient or cuDNN attention kernel, and none is enabled "
            f"for this model's attention ({COMPUTE_DTYPE}, {heads} query / {kv_heads} key-value "
            f"heads of {head_dim}) on this GPU; train in bf16 (a project generated with --bf16) or run with "
            "--parallel.cp 1"
        )


def sequence_shards(batches: list[MicroBatch], mesh: DeviceMesh, device: torch.device) -> Iterator[MicroBatch]:
    """Each micro-batch, this rank's pieces of its sequences, on `device`, with `positions` saying where each token
    sits in its sequence (model.py's rotary positions).

    The caller's forward and backward of a micro-batch run while this generator waits at its `yield`, inside the
    context that splits the sequence and makes attention a ring over mesh["cp"]; asking for the next micro-batch
    leaves it. With one process (`python train.py`, no cp in the mesh) the whole sequences come, as they are.
    """
    if "cp" not in (mesh.mesh_dim_names or ()):
        for batch in batches:
            yield batch.to(device)
        return
    set_rotate_method("allgather")
    for batch in batches:
        # Copies: context_parallel replaces each buffer's contents with this rank's pieces, in place. (No document
        # ids: preflight refused data.document_mask with cp > 1.)
        inputs, targets = batch.inputs.to(device, copy=True), batch.targets.to(device, copy=True)
        positions = torch.arange(inputs.shape[SEQ_DIM], device=device).repeat(inputs.shape[0], 1)
        buffers = [inputs, targets, positions]
        with context_parallel(
            mesh["cp"], buffers=buffers, buffer_seq_dims=[SEQ_DIM] * 3, no_restore_buffers=set(buffers)
        ):
            yield MicroBatch(inputs, targets, positions)
