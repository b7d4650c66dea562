"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).

The model is written so that FSDP2 can build it on the meta device and shard it
block by block: every `TransformerBlock` becomes one `fully_shard` unit, and
`init_weights` fills parameters *after* sharding without ever materialising a
full copy of the model, or even of one parameter, on one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from schema import MAX_COUNT, Rule, setting
from sharded_init import fill_by_blocks

if TYPE_CHECKING:
    from config import Config, ParallelConfig

# Model settings a resume may change (preflight.py compares the others with the checkpoint): the length
# of the rotary tables (not saved) and the initialisation scale, which a loaded checkpoint does not depend on.
RESUME_MAY_CHANGE = ("max_seq_len", "init_std")

# model.size presets: a debug model that runs anywhere, a GPT-2-small-sized one, and the shapes of Llama 3.2 1B
# (whose released weights tie the output layer to the embedding: model.tie_embeddings) and Llama 3.1 8B.
SIZES = {
    "debug": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512, "ffn_dim": 688,
              "max_seq_len": 512, "rope_theta": 10000.0},
    "125m": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 32000, "ffn_dim": 2048,
             "max_seq_len": 2048, "rope_theta": 10000.0},
    "1b": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_dim": 8192,
           "max_seq_len": 8192, "rope_theta": 500000.0},
    "8b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_dim": 14336,
           "max_seq_len": 8192, "rope_theta": 500000.0},
}  # fmt: skip


# model.size's value for a key left at 0.
PRESET = "the value of model.size"


@dataclass
class ModelArgs:
    size: Literal["debug", "125m", "1b", "8b"] = "debug"
    # 0: the value of `size`; any other value overrides it. The bounds (schema.py) hold for the value in use.
    dim: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    n_layers: int = setting(0, low=1, high=4096, zero=PRESET)  # 4096: building more blocks takes minutes
    n_heads: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    n_kv_heads: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    vocab_size: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    ffn_dim: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    max_seq_len: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    # Below 1 the rotary frequencies theta**(-i/d) grow past float32's range: the tables become NaN.
    rope_theta: float = setting(0.0, low=1, zero=PRESET)
    norm_eps: float = setting(1e-5, positive=True, high=1)
    init_std: float = setting(0.02, positive=True, high=1)  # above 1 the first logits overflow fp16/bf16
    tie_embeddings: bool = False  # the output layer reuses the token embedding matrix

    def __post_init__(self) -> None:
        for key, value in SIZES[self.size].items():
            if not getattr(self, key):
                setattr(self, key, value)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x matmul parameters + attention scores (PaLM appendix B)."""
        head_dim = self.dim // self.n_heads
        attention = self.dim * (self.n_heads + 2 * self.n_kv_heads) * head_dim + self.dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        matmul_params = self.n_layers * (attention + mlp) + self.dim * self.vocab_size
        return 6 * matmul_params + 12 * self.n_layers * self.dim * seq_len


# The rules between the keys above (config.py checks them after each key's own bounds, in this order).
MODEL_RULES = [
    Rule(
        lambda c: c.model.dim % c.model.n_heads == 0,
        "model.dim ({c.model.dim}) must be divisible by model.n_heads ({c.model.n_heads}); change one of them",
    ),
    Rule(
        lambda c: c.model.n_heads % c.model.n_kv_heads == 0,
        "model.n_heads ({c.model.n_heads}) must be divisible by model.n_kv_heads ({c.model.n_kv_heads}); change "
        "one of them",
    ),
    Rule(
        lambda c: c.model.head_dim % 2 == 0,
        "model.dim / model.n_heads = {c.model.dim} / {c.model.n_heads} = {c.model.head_dim} is odd, but rotary "
        "embeddings turn pairs of values; choose an even head size",
    ),
]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when the parameters run in bf16/fp16.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of a (batch, seq, heads, head_dim) tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
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
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

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
        device = self.output.weight.device
        generator = torch.Generator(device=device).manual_seed(seed)
        residual_std = self.args.init_std / math.sqrt(2 * self.args.n_layers)
        # named_parameters() lists a tied output weight once, as tok_embeddings.weight.
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                fill_by_blocks(param, lambda block: block.fill_(1.0))
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                # Residual projections are scaled down so the residual stream does not grow with depth.
                fill_by_blocks(param, lambda block: block.normal_(0.0, residual_std, generator=generator))
            else:
                fill_by_blocks(param, lambda block: block.normal_(0.0, self.args.init_std, generator=generator))
        self._init_rope(buffer_device or device)

    def _init_rope(self, device: torch.device) -> None:
        head_dim = self.args.dim // self.args.n_heads
        inv_freq = 1.0 / self.args.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        angles = torch.outer(torch.arange(self.args.max_seq_len, device=device).float(), inv_freq)
        # Assigning to a registered buffer replaces it (still non-persistent), on `device`.
        self.rope_cos = angles.cos()
        self.rope_sin = angles.sin()


# ---- What train.py calls: every family's model.py provides these four -------------------------------------


def build_model(config: Config) -> Transformer:
    """The model of config.model, with fp32 parameters; train.py calls it under torch.device("meta")."""
    return Transformer(config.model)


def block_classes(model: Transformer, parallel: ParallelConfig) -> list[str]:
    """The classes of the repeated blocks: each such module is fully_shard-ed on its own."""
    return ["TransformerBlock"]


def initialize(model: Transformer, config: Config, device: torch.device) -> None:
    """Fill every parameter and buffer after to_empty, on the sharded model; the rotary tables go to `device`
    (also when CPU offload keeps the parameters in CPU memory)."""
    model.init_weights(seed=config.training.seed, buffer_device=device)


def output_logits(output: torch.Tensor) -> torch.Tensor:
    """The logits (batch, seq, vocab_size) of model(tokens): its output itself."""
    return output
