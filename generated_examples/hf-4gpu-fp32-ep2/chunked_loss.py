"""The training loss of every model family: the output layer's cross-entropy, computed in sequence chunks.

With a large vocabulary the logits are the largest tensors of a step: batch 2 x 8192 tokens x 128,256 words is
8.4 GB in fp32, and as much again for their gradient, next to 0.13 GB of hidden states (dim 4096, bf16). Here
each chunk of the sequence is projected and its loss computed on its own, under torch.utils.checkpoint: forward
keeps only the chunk's hidden states, and backward recomputes the chunk's logits when it reaches them. At most
one chunk's logits (their fp32 copy, their gradient) are alive at a time, for the price of one more forward of
the output layer (training.loss_chunks in config.toml).

Each model calls it inside its own forward (model(tokens, targets=...)), never after it: FSDP2 all-gathers the
output layer's weight only inside the root module's __call__ (its forward hooks), and keeps the root's gathered
parameters until backward, where the chunks are recomputed. Called after forward, the weight would be this
rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from data import IGNORE


def chunked_cross_entropy(
    hidden: torch.Tensor,
    output_layer: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    chunks: int,
    reduction: str = "mean",
) -> torch.Tensor:
    """The fp32 cross-entropy of output_layer(hidden) (the logits, batch x seq x vocab) against `targets` (batch x
    seq), targets equal to IGNORE not counted; reduction "mean" (over the counted targets) or "sum".

    chunks = 1 is the plain computation (the whole logits at once); chunks > 1 splits the sequence in that many
    equal chunks (config.py's rule: they divide training.seq_len), each recomputed in backward."""
    if chunks == 1:
        return cross_entropy(output_layer, hidden, targets, reduction)
    pieces = zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1), strict=True)
    # Non-reentrant checkpoint: the chunk's logits are not kept for backward, which runs the chunk again.
    total = sum(checkpoint(cross_entropy, output_layer, h, t, "sum", use_reentrant=False) for h, t in pieces)
    return total if reduction == "sum" else total / (targets != IGNORE).sum()


def cross_entropy(
    output_layer: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, reduction: str
) -> torch.Tensor:
    """The cross-entropy of one chunk (or the whole sequence), in fp32 whatever the compute dtype."""
    logits = output_layer(hidden).flatten(0, 1).float()
    return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction=reduction)
