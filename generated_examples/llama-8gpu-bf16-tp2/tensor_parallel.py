"""Tensor parallelism for the llama model (model.py), in torchtitan's layout: train.py's build_model_meta applies
it on the meta model, before fully_shard shards what each tp rank keeps over the data-parallel ranks."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from model import Transformer

# What train.py uses: loss_parallel (torch's), the context its loss and the loss's backward run in.
__all__ = ["apply_tensor_parallel", "local_loss", "loss_parallel"]


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Split the model across the tp ranks (Megatron-style, with sequence and loss parallelism, as torchtitan
    does), before FSDP shards what each rank keeps over the data-parallel ranks.

    Between the blocks' matmuls the activations are split along the sequence (Shard(1)): each tp rank holds
    and normalises 1/tp of the tokens. Each attention and MLP all-gathers its input to the full sequence,
    computes its share of the heads / hidden units (wq/wk/wv and w1/w3 split their outputs), and wo / w2
    reduce-scatter the partial sums back to sequence shards. The embedding and the output layer split the
    vocabulary: the logits stay split by vocabulary, and loss_parallel computes the loss from the pieces,
    so no rank ever holds the full logits. preflight.py made sure that tp divides the heads, the MLP width
    and training.seq_len.
    """
    plan = {
        # Each rank looks up the tokens of its vocabulary rows (the others give 0); the sum over ranks is
        # reduce-scattered so each rank gets its 1/tp of the sequence.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # The final norm, like the blocks' norms, normalises this rank's tokens.
        "norm": SequenceParallel(),
        # Gathers the full sequence and computes this rank's slice of the vocabulary, left a DTensor
        # (Shard(-1)) so that train_step's loss_parallel can compute the loss from the slices. With
        # training.loss_chunks > 1 the model splits the final norm's output (split by sequence) into chunks
        # first: DTensor gathers the sequence once for that split, and each chunk comes here whole.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, plan)
    if model.args.tie_embeddings:
        # Both layers split the (vocab, dim) matrix by vocabulary rows, so one parameter still serves both; but
        # parallelize_module gave each module a new parameter of its own: tie them again.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = {
            # A norm works token by token: each rank normalises its own tokens.
            "attention_norm": SequenceParallel(),
            # Attention needs the whole sequence (causal mask, rotary positions 0..seq_len-1): gather it.
            # The rotary tables (cos, sin) and the document mask (document_attention.py) pass as they are.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            ),
            "attention.wq": ColwiseParallel(),  # this rank's heads; model.py views them as (-1, head_dim)
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, plan)


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """This rank's copy of a loss computed under loss_parallel: it comes out replicated over the tp ranks (a
    DTensor), each rank's local tensor the whole loss."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
