"""Activation checkpointing: what each block keeps for backward and what backward recomputes.

parallel.activation_checkpointing picks the mode:
- "selective" (op-level, as torchtitan does): every block runs under a policy that keeps the outputs of the
  expensive ops (matmuls, but every second one; attention; reduce-scatters; max, which float8 scaling needs) and
  recomputes the cheap element-wise ones (norms, activations, rotary, residual adds) in backward.
- "layer": every activation_checkpoint_every-th block keeps only its input and recomputes all of its activations.
- "full": every block does that (least memory, about one extra forward).
All wrappers are non-reentrant, the variant that works with FSDP2's hooks; each gives the same numbers as none.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# The matmuls, of which "selective" keeps every other output: a linear layer without bias is aten.mm, one with a
# bias (the custom family's, many Hugging Face models' q/k/v) aten.addmm, and a float8 one (torchao) aten._scaled_mm.
MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
}
# Ops whose outputs "selective" keeps: costly to recompute, and (but for the matmuls' every second output) small
# next to the element-wise activations around them. The attention variants cover the CUDA kernels and CPU's flash.
SAVE = {
    *MATMULS,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def op_policy(counts: dict[str, int]) -> Any:
    """The per-op choice for one block call. `counts` numbers the block's matmuls, separately in forward and in
    the recompute, so that both pass the same ops the same way: the recompute must produce exactly what forward
    did not save."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        phase = "recompute" if ctx.is_recompute else "forward"
        if op in MATMULS:
            counts[phase] += 1
            if counts[phase] % 2 == 0:  # every second matmul is recomputed: half their memory, a third of a forward
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_level_contexts() -> Any:
    """checkpoint's context_fn: called once per block call, so the matmul count starts afresh for each."""
    return create_selective_checkpoint_contexts(op_policy(defaultdict(int)))


def checkpoint_block(block: nn.Module, index: int, parallel: Any) -> nn.Module:
    """The block (the index-th) in the wrapper parallel.activation_checkpointing asks for, or as it is."""
    mode = parallel.activation_checkpointing
    if mode == "selective":
        return checkpoint_wrapper(block, context_fn=op_level_contexts)
    if mode == "full" or (mode == "layer" and index % parallel.activation_checkpoint_every == 0):
        return checkpoint_wrapper(block)
    return block


class ActivationCheckpointError(Exception):
    """A mode this model cannot use: the message is one line that names the problem and the fix."""


class _FirstBlockCall(Exception):
    """Raised by a hook to stop the meta forward at the first block, with that block's inputs."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


def check_op_level(model: nn.Module, block_names: list[str], seq_len: int) -> None:
    """Op-level "selective" must find matmuls to keep in the model's blocks. `model` is built on the meta
    device: its first block (a class of `block_names`) runs once, as fake tensors, under the policy, on the inputs
    the model gives it for a (1, seq_len) batch; nothing is computed or allocated. A block whose matrix products
    are not linear layers (e.g. einsum or matmul of 3-D tensors: aten.bmm) would keep nothing but attention's
    output and recompute the rest in backward, a full forward's cost for far less than full's memory saving."""
    block = next(module for module in model.modules() if type(module).__name__ in block_names)
    ops: list[Any] = []
    policy = op_policy(defaultdict(int))

    def recording(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        ops.append(op)
        return policy(ctx, op, *args, **kwargs)

    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _FirstBlockCall(args, kwargs)

    hook = block.register_forward_pre_hook(stop, with_kwargs=True)
    # Fake tensors on the meta device: Hugging Face models skip their data-dependent checks (.item()) for them.
    with FakeTensorMode(allow_non_fake_inputs=True):
        try:
            model(torch.zeros((1, seq_len), dtype=torch.long, device="meta"))
            return  # the forward never called the block: nothing to check
        except _FirstBlockCall as call:
            inputs = call
        finally:
            hook.remove()
        context_fn = lambda: create_selective_checkpoint_contexts(recording)  # noqa: E731
        checkpoint(block, *inputs.args, use_reentrant=False, context_fn=context_fn, **inputs.kwargs)
    if not any(op in MATMULS for op in ops):
        products = sorted({str(op).removesuffix(".default") for op in ops if "mm" in str(op)})
        found = f"its matrix products run as {', '.join(products)}" if products else "it runs no matrix product"
        raise ActivationCheckpointError(
            f"parallel.activation_checkpointing = 'selective' keeps the outputs of linear layers (aten.mm/addmm"
            f"/_scaled_mm), but block {type(block).__name__} has none ({found}): it would recompute nearly all of "
            "the block; use --parallel.activation_checkpointing layer or full, or make the block's linear layers "
            "nn.Linear"
        )
