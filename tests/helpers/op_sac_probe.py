"""Run inside a generated project (PYTHONPATH=project) whose answer has activation checkpointing: for one
TransformerBlock of the given shape and each parallel.activation_checkpointing mode, what activation_checkpoint.py's
policy decided per op (forward and recompute) and the bytes the block holds for backward after its forward.

Held bytes: every tensor an op creates during the block's forward is noted (by storage, weakly); those still alive
once forward has returned, other than the block's output, are what the block keeps for backward (autograd's saved
tensors, or selective AC's cache of kept outputs). Prints one JSON object.
"""

from __future__ import annotations

import gc
import json
import sys
from types import SimpleNamespace

import activation_checkpoint
import torch
from model import TransformerBlock, rotary_tables
from model_args import ModelArgs
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Created(TorchDispatchMode):
    """Notes the storage of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[int, StorageWeakRef, int]] = []  # a freed storage's address may come back

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self.storages.append((storage.data_ptr(), StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive_bytes(self, *exclude: torch.Tensor) -> int:
        skip = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        alive = {ptr: n for ptr, ref, n in self.storages if ptr not in skip and not ref.expired()}
        return sum(alive.values())


def main() -> None:
    gc.freeze()  # the imports outlive the probe: keep them out of the collector's full passes
    dim, n_heads, n_kv_heads, ffn_dim, batch, seq_len = (int(value) for value in sys.argv[1:7])
    args = ModelArgs(dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=8, ffn_dim=ffn_dim,
                     max_seq_len=seq_len)  # fmt: skip
    torch.manual_seed(0)
    half = args.head_dim // 2
    # The factors Transformer.forward builds once for all blocks from its (seq, head_dim / 2) tables.
    cos, sin = rotary_tables(torch.rand(seq_len, half), torch.rand(seq_len, half))
    decisions: list[tuple[str, str, str]] = []
    make_policy = activation_checkpoint.op_policy

    def recording_policy(counts: dict[str, int]):  # noqa: ANN202
        policy = make_policy(counts)

        def record(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
            choice = policy(ctx, op, *args, **kwargs)
            decisions.append(("recompute" if ctx.is_recompute else "forward", str(op), choice.name))
            return choice

        return record

    activation_checkpoint.op_policy = recording_policy
    report: dict = {}
    grads = {}
    for mode in ("none", "selective", "layer", "full"):
        block = TransformerBlock(args, 0)
        torch.manual_seed(1)
        for parameter in block.parameters():
            torch.nn.init.normal_(parameter, std=0.1)
        parallel = SimpleNamespace(activation_checkpointing=mode, activation_checkpoint_every=2)
        wrapped = activation_checkpoint.checkpoint_block(block, 0, parallel)
        x = torch.randn(batch, seq_len, dim, generator=torch.Generator().manual_seed(2), requires_grad=True)
        decisions.clear()
        with Created() as created:
            out = wrapped(x, cos, sin)
        gc.collect()
        held = created.alive_bytes(out, x, cos, sin, *block.parameters())  # views of these are not new
        out.square().sum().backward()
        grads[mode] = [x.grad, *(p.grad for p in block.parameters())]
        report[mode] = {"held_bytes": held, "decisions": list(decisions)}
    report["max_grad_diff"] = {
        mode: max((a - b).abs().max().item() for a, b in zip(grads["none"], grads[mode], strict=True)) for mode in grads
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
