"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).

The model is written so that FSDP2 can build it on the meta device and shard it
block by block: every `TransformerBlock` becomes one `fully_shard` unit, and
`init_weights` fills parameters *after* sharding without ever materialising a
full copy of the model, or even of one parameter, on one rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from chunked_loss import chunked_cross_entropy
from document_attention import Mask, attention, document_mask
from model_args import MODEL_RULES, RESUME_MAY_CHANGE, SIZES, ModelArgs
from sharded_init import fill_by_blocks

if TYPE_CHECKING:  # config.py imports model_args.py, never this file: no import cycle, and no torch to read a config
    from config import Config

# The names train.py, preflight.py and the scripts import from every family's model.py (AGENTS.md lists them);
# SIZES: the model.size presets.
__all__ = ["MODEL_RULES", "RESUME_MAY_CHANGE", "SIZES", "Model", "ModelArgs", "balance_experts", "block_classes",
           "build_model", "initialize", "loss", "output_logits"]  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when the parameters run in bf16/fp16.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq, head_dim / 2) or (batch, seq, head_dim / 2) tables -> the (1 or batch, seq, 1, head_dim) factors of
    `apply_rotary`: (cos, cos), (-sin, sin)."""
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return cos[:, :, None, :], sin[:, :, None, :]


def rotary_frequencies(args: ModelArgs, device: torch.device) -> torch.Tensor:
    """The rotary inverse frequencies rope_theta**(-2i / head_dim), one per pair of a head's values; with
    model.rope_type "llama3", scaled as Llama 3.1 and 3.2 scale them: transformers' _compute_llama3_parameters
    (modeling_rope_utils.py) step for step, so that a Llama 3.x checkpoint gets its own rotary tables."""
    head_dim = args.dim // args.n_heads
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if args.rope_type == "default":
        return inv_freq
    factor, low, high = args.rope_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_context = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than the original context / low (the slowest turns): slowed down `factor` times more.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    # Between old_context / high and old_context / low: interpolated between slowed down and unchanged.
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    # (Shorter wavelengths than old_context / high, the fastest turns, are left as they are.)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of a (batch, seq, heads, head_dim) tensor by the angles of
    `rotary_tables`: (x1 cos - x2 sin, x2 cos + x1 sin).

    Written as x * (cos, cos) + roll(x) * (-sin, sin), which gives the same bits as rotating each half: three
    whole-tensor ops and one copy (roll), where slicing the halves and concatenating the results took eight
    ops forward and zero-filled slice gradients backward (4-5% of a CPU step at seq 256, torch.profiler).
    """
    x_float = x.float()
    rotated = x_float * cos + x_float.roll(x.shape[-1] // 2, dims=-1) * sin
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Causal, and within each document when `mask` keeps packed documents apart (document_attention.py).
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the layer index (as torchtitan does): parameter names layers.7.*, as a ModuleList's.
        blocks = [TransformerBlock(args, index) for index in range(args.n_layers)]
        self.layers = nn.ModuleDict({str(index): block for index, block in enumerate(blocks)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            # One parameter under two names: fully_shard keeps it in the root's group, which holds both
            # modules (torch >= 2.13 refuses to split a shared parameter across groups).
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived, not learned: non-persistent, so they are never
        # checkpointed and must be recomputed after `to_empty` (see `init_weights`).
        head_dim = args.dim // args.n_heads
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, head_dim // 2), persistent=False)

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
        seq_len = tokens.shape[1]
        # Built once per forward for all blocks: (seq, head_dim) each, a few KB (per row with positions).
        if positions is None:
            cos, sin = rotary_tables(self.rope_cos[:seq_len], self.rope_sin[:seq_len])
        else:  # per-token positions: restarting per document
            cos, sin = rotary_tables(self.rope_cos[positions], self.rope_sin[positions])
        mask = document_mask(document_ids)  # None: plain causal attention
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if targets is None:
            return self.output(self.norm(h))
        return chunked_cross_entropy(self.norm(h), self.output, targets, loss_chunks, reduction)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer, sharded or not, identically for any world size.

        Each parameter's values are drawn from one generator seeded with `seed`, in a
        fixed order and in fixed row blocks, and each rank keeps only the rows and
        columns of its own shard. (Random ops on a sharded DTensor would instead give
        every rank the *same* local values, so a 4-rank model would differ from a
        1-rank one.) Extra memory is one block of at most INIT_BLOCK_ELEMENTS values.
        The rotary tables go to `buffer_device` (default: where the parameters are).
        """
        # Under the names of the whole model: the wrappers of activation checkpointing and compile add a part to the
        # names of a block's parameters (layers.7._checkpoint_wrapped_module.attention.wq.weight).
        present = {
            name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): param
            for name, param in self.named_parameters()
        }
        device = next(iter(present.values())).device
        generator = torch.Generator(device=device).manual_seed(seed)
        residual_std = self.args.init_std / math.sqrt(2 * self.args.n_layers)

        def ones(block: torch.Tensor) -> torch.Tensor:
            return block.fill_(1.0)

        def residual(block: torch.Tensor) -> torch.Tensor:
            return block.normal_(0.0, residual_std, generator=generator)

        def normal(block: torch.Tensor) -> torch.Tensor:
            return block.normal_(0.0, self.args.init_std, generator=generator)

        # named_parameters() lists a tied output weight once, as tok_embeddings.weight.
        for name, param in present.items():
            # Residual projections are scaled down so the residual stream does not grow with depth.
            fill = ones if name.endswith("norm.weight") else normal
            if name.endswith(("wo.weight", "w2.weight")):
                fill = residual
            fill_by_blocks(param, fill)
        self._init_rope(buffer_device or device)

    def _init_rope(self, device: torch.device) -> None:
        inv_freq = rotary_frequencies(self.args, device)
        angles = torch.outer(torch.arange(self.args.max_seq_len, device=device).float(), inv_freq)
        # Assigning to a registered buffer replaces it (still non-persistent), on `device`.
        self.rope_cos = angles.cos()
        self.rope_sin = angles.sin()


# ---- What train.py calls: every family's model.py provides these names (AGENTS.md: the model interface) ------

# The model's class, under the name every family gives it.
Model = Transformer


def build_model(config: Config) -> Model:
    """The model of config.model, with fp32 parameters; train.py calls it under torch.device("meta")."""
    return Model(config.model)


def block_classes(model: Model, shard_modules: list[str]) -> list[str]:
    """The classes of the repeated blocks (parallel.shard_modules): each such module is fully_shard-ed on its own."""
    return shard_modules


def initialize(model: Model, config: Config, device: torch.device) -> None:
    """Fill every parameter and buffer after to_empty, on the sharded model or a plain one (never fully_shard-ed);
    the rotary tables go to `device` (also when CPU offload keeps the parameters in CPU memory)."""
    if model.args.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
        # to_empty gives each module of a plain model its own copy of a tied weight (fully_shard keeps it one
        # tensor): tie them again before they are filled.
        model.output.weight = model.tok_embeddings.weight
    model.init_weights(seed=config.training.seed, buffer_device=device)


def balance_experts(model: Model, config: Config) -> dict[str, torch.Tensor]:
    """After each step's micro-batches and optimizer step: a mixture-of-experts model balances its experts' load
    here and returns figures for metrics.jsonl; this dense model has none (`fsdp2gen update --moe` adds them)."""
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
    at a time, inside model(...) (chunked_loss.py). `positions`: each token's rotary position (None: 0..seq-1);
    `document_ids`: a token attends only to earlier tokens of the same id (None: one document per row)."""
    return model(
        tokens, positions=positions, document_ids=document_ids, targets=targets, reduction=reduction, loss_chunks=chunks
    )
