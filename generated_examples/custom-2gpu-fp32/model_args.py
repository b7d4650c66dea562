"""Your model's settings: the [model] section of config.toml, with each key's bounds, the rules between keys, and
what a resume may change. No torch here, so that reading a config (config.py, preflight.py, the data scripts)
starts fast; model.py builds the model from ModelArgs. Add a key here when your model needs one.
"""

from __future__ import annotations

from dataclasses import dataclass

from schema import MAX_COUNT, Rule, setting

# Model settings a resume may change (preflight.py compares the others with the checkpoint): the
# initialisation scale, which a loaded checkpoint does not depend on.
RESUME_MAY_CHANGE = ("init_std",)


@dataclass
class ModelArgs:
    # Each key's bounds are declared here, once (schema.py); config.py checks them, and MODEL_RULES below.
    vocab_size: int = setting(512, low=1, high=MAX_COUNT)
    dim: int = setting(256, low=1, high=MAX_COUNT)
    n_layers: int = setting(4, low=1, high=4096)  # 4096: building more blocks takes minutes
    n_heads: int = setting(8, low=1, high=MAX_COUNT)
    max_seq_len: int = setting(512, low=1, high=MAX_COUNT)
    init_std: float = setting(0.02, positive=True, high=1)  # above 1 the first logits overflow fp16/bf16

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x matmul parameters + attention scores (PaLM appendix B)."""
        matmul_params = self.n_layers * 12 * self.dim * self.dim + self.dim * self.vocab_size
        return 6 * matmul_params + 12 * self.n_layers * self.dim * seq_len


# The rules between the keys above (config.py checks them after each key's own bounds, in this order).
MODEL_RULES = [
    Rule(
        lambda c: c.model.dim % c.model.n_heads == 0,
        "model.dim ({c.model.dim}) must be divisible by model.n_heads ({c.model.n_heads}); change one of them",
    ),
]
