"""Your model. train.py shards, trains and checkpoints whatever this file defines, as long as:

- `Model(args)` builds it from `ModelArgs` (model_args.py: the [model] section of config.toml) without reading its
  parameters: train.py builds it under `torch.device("meta")`, where nothing is allocated;
- `model(tokens)` maps token ids (batch, seq) to logits (batch, seq, vocab_size), and `model(tokens, targets, ...)`
  to the loss, which the output layer computes chunk by chunk (chunked_loss.py);
- `init_weights(seed)` fills every parameter and buffer: train.py calls it after `to_empty`, on the
  sharded model, where the memory holds garbage until then;
- `tie_weights()` makes modules share a weight (here the output layer and the token embedding), or does nothing:
  called again after `to_empty`, which gives each module of a plain (never sharded) model its own copy;
- the class names of its repeated blocks are listed in config.toml's `parallel.shard_modules`: each such
  module becomes one FSDP unit, the rest of the model (embeddings, final norm, output) the root's.

train.py reaches the model only through the functions at the end of this file (every model family's model.py
has them: AGENTS.md lists the interface); they need no change unless the constructor, init_weights or the output
above do.

The default is a small GPT-style decoder so that everything runs as generated. Edit the part between the
two `Your model` lines; keep ModelArgs.flops_per_token (model_args.py) roughly right if you want MFU to mean something.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from chunked_loss import chunked_cross_entropy
from document_attention import Mask, attention, document_mask
from model_args import MODEL_RULES, RESUME_MAY_CHANGE, ModelArgs
from sharded_init import fill_by_blocks

if TYPE_CHECKING:  # config.py imports model_args.py, never this file: no import cycle, and no torch to read a config
    from config import Config

# The names train.py, preflight.py and the scripts import from every family's model.py (AGENTS.md lists them).
__all__ = ["MODEL_RULES", "RESUME_MAY_CHANGE", "Model", "ModelArgs", "balance_experts", "block_classes", "build_model",
           "initialize", "loss", "output_logits"]  # fmt: skip


# ---- Your model: edit from here ------------------------------------------------------------------------


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP. One FSDP unit each."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.attention_norm = nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.attention_out = nn.Linear(args.dim, args.dim)
        self.mlp_norm = nn.LayerNorm(args.dim)
        self.mlp_in = nn.Linear(args.dim, 4 * args.dim)
        self.mlp_out = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, seq_len, 3, self.n_heads, -1).unbind(2)
        # Causal, and within each document when `mask` keeps packed documents apart (document_attention.py).
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        x = x + self.attention_out(out.transpose(1, 2).reshape(batch, seq_len, dim))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        # Keyed by the layer index: parameter names layers.7.*, as a ModuleList's.
        blocks = [Block(args) for _ in range(args.n_layers)]
        self.layers = nn.ModuleDict({str(index): block for index, block in enumerate(blocks)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tied: the output layer reuses the token embedding matrix, one parameter under two names (both stay in the
        root's FSDP group). Leave the body out to untie them."""
        self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        reduction: str = "mean",
        loss_chunks: int = 1,
    ) -> torch.Tensor:
        """The logits (batch, seq, vocab_size); with `targets`, the loss instead (chunked_loss.py), computed
        here so that FSDP2's hooks around this call gather the output layer's weight for it. `positions` and
        `document_ids` (batch, seq): see loss()."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        mask = document_mask(document_ids)  # None: plain causal attention
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h, mask)
        if targets is None:
            return self.output(self.norm(h))
        return chunked_cross_entropy(self.norm(h), self.output, targets, loss_chunks, reduction)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter (and buffer, if you add any): the rules below, one per kind of tensor.

        `fill_by_blocks` draws each full tensor from one generator and keeps this rank's shard, so the
        model is the same for any number of ranks (a random op on a shard would draw the same values on
        every rank). Tied parameters appear once in named_parameters().
        """
        generator = torch.Generator(device=self.tok_embeddings.weight.device).manual_seed(seed)
        residual_std = self.args.init_std / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                fill_by_blocks(param, lambda block: block.fill_(1.0))
            elif name.endswith(".bias"):
                fill_by_blocks(param, lambda block: block.zero_())
            elif name.endswith(("attention_out.weight", "mlp_out.weight")):
                # Residual projections are scaled down so the residual stream does not grow with depth.
                fill_by_blocks(param, lambda block: block.normal_(0.0, residual_std, generator=generator))
            else:
                fill_by_blocks(param, lambda block: block.normal_(0.0, self.args.init_std, generator=generator))


# ---- Your model: end -----------------------------------------------------------------------------------

# ---- What train.py calls: every family's model.py provides these names (AGENTS.md: the model interface) ------


def build_model(config: Config) -> Model:
    """The model of config.model, with fp32 parameters; train.py calls it under torch.device("meta")."""
    return Model(config.model)


def block_classes(model: Model, shard_modules: list[str]) -> list[str]:
    """The classes of the repeated blocks (parallel.shard_modules): each such module is fully_shard-ed on its own."""
    return shard_modules


def initialize(model: Model, config: Config, device: torch.device) -> None:
    """Fill every parameter and buffer after to_empty, on the sharded model or a plain one (never fully_shard-ed)."""
    # to_empty gives each module of a plain model its own copy of a tied weight (fully_shard keeps it one tensor):
    # tie them again before they are filled.
    model.tie_weights()
    model.init_weights(seed=config.training.seed)


def balance_experts(model: Model, config: Config) -> dict[str, torch.Tensor]:
    """Called after each step's micro-batches, before the optimizer step: a mixture-of-experts model balances
    its experts' load here and returns figures for metrics.jsonl; this one has none."""
    return {}


def output_logits(output: torch.Tensor) -> torch.Tensor:
    """The logits (batch, seq, vocab_size) of model(tokens): its output itself."""
    return output


def loss(
    model: Model,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    reduction: str = "mean",
    chunks: int = 1,
) -> torch.Tensor:
    """The cross-entropy of the model on `tokens` against `targets` (batch, seq), in fp32 whatever the compute dtype,
    targets equal to IGNORE not counted; the logits computed in `chunks` sequence chunks (training.loss_chunks), one
    at a time, inside model(...) (chunked_loss.py). `positions`: each token's position (None: 0..seq-1);
    `document_ids`: a token attends only to earlier tokens of the same id (None: one document per row). Change
    it, and forward, if your model's loss is not plain cross-entropy (e.g. add an auxiliary loss)."""
    return model(
        tokens, positions=positions, document_ids=document_ids, targets=targets, reduction=reduction, loss_chunks=chunks
    )
