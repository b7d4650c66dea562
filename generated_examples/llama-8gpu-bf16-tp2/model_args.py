"""The Llama model's settings (the [model] section of config.toml), their presets and rules: no torch here, so that
reading a config (config.py, preflight.py, the data scripts) starts fast. model.py builds the model from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schema import MAX_COUNT, Rule, setting

# Model settings a resume may change (preflight.py compares the others with the checkpoint): the length
# of the rotary tables (not saved), and the initialisation scale, which a loaded checkpoint does not depend on.
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
    # Rotary scaling (rotary_frequencies in model.py). "default": none. "llama3": Llama 3.1 and 3.2's (their
    # config.json's rope_type "llama3", as transformers computes it): wavelengths below rope_original_max_seq_len /
    # rope_high_freq_factor are kept, those above rope_original_max_seq_len / rope_low_freq_factor are divided
    # by rope_factor, and those between are interpolated. The defaults are Llama 3.1's (Llama 3.2: factor 32).
    rope_type: Literal["default", "llama3"] = "default"
    rope_factor: float = setting(8.0, low=1)
    rope_low_freq_factor: float = setting(1.0, positive=True)
    rope_high_freq_factor: float = setting(4.0, positive=True)
    rope_original_max_seq_len: int = setting(8192, low=1, high=MAX_COUNT)
    norm_eps: float = setting(1e-5, positive=True, high=1)
    init_std: float = setting(0.02, positive=True, high=1)  # above 1 the first logits overflow fp16/bf16
    tie_embeddings: bool = False  # the output layer reuses the token embedding matrix

    def __post_init__(self) -> None:
        for key, value in SIZES[self.size].items():
            if getattr(self, key) == 0:
                setattr(self, key, value)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x the matmul parameters + attention scores (PaLM appendix B)."""
        blocks = sum(self.block_flops_per_token(layer, seq_len) for layer in range(self.n_layers))
        return blocks + self.output_flops_per_token()

    def block_flops_per_token(self, layer: int, seq_len: int) -> int:
        """flops_per_token's share of block `layer`."""
        head_dim = self.dim // self.n_heads
        attention = self.dim * (self.n_heads + 2 * self.n_kv_heads) * head_dim + self.dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        return 6 * (attention + mlp) + 12 * self.dim * seq_len

    def output_flops_per_token(self) -> int:
        """flops_per_token's share of the output layer (the embedding is a lookup: no matmul)."""
        return 6 * self.dim * self.vocab_size


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
        lambda c: c.model.rope_type != "llama3" or c.model.rope_high_freq_factor > c.model.rope_low_freq_factor,
        'model.rope_type "llama3" interpolates between the wavelengths of model.rope_high_freq_factor '
        "({c.model.rope_high_freq_factor}) and model.rope_low_freq_factor ({c.model.rope_low_freq_factor}): the "
        "high one must be the larger; e.g. Llama 3.1's 4.0 and 1.0",
    ),
    Rule(
        lambda c: c.model.head_dim % 2 == 0,
        "model.dim / model.n_heads = {c.model.dim} / {c.model.n_heads} = {c.model.head_dim} is odd, but rotary "
        "embeddings turn pairs of values; choose an even head size",
    ),
]
