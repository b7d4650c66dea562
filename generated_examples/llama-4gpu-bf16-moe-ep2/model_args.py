"""The Llama model's settings (the [model] section of config.toml), their presets and rules: no torch here, so that
reading a config (config.py, preflight.py, the data scripts) starts fast. model.py builds the model from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schema import MAX_COUNT, Rule, setting

# Model settings a resume may change (preflight.py compares the others with the checkpoint): the length
# of the rotary tables (not saved), the initialisation scale, which a loaded checkpoint does not depend on, and
# how strongly mixture-of-experts routing is balanced (training knobs, not shapes).
RESUME_MAY_CHANGE = ("max_seq_len", "init_std", "expert_bias_rate", "aux_loss_coef")

# model.size presets: a debug model that runs anywhere, a GPT-2-small-sized one, and the shapes of Llama 3.2 1B
# (whose released weights tie the output layer to the embedding: model.tie_embeddings) and Llama 3.1 8B.
# Mixture-of-experts presets (n_experts > 0): a debug one, and the expert layouts of Qwen3-30B-A3B (128 experts,
# top 8, softmax) and DeepSeek-V3 (256 routed experts, top 8, sigmoid, 1 shared expert, 3 dense layers first),
# "-like" because attention here is grouped-query with head_dim = dim / n_heads (Qwen3's head_dim is 128 at dim
# 2048; DeepSeek-V3 uses multi-head latent attention, about as many parameters as the MHA given here).
SIZES = {
    "debug": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512, "ffn_dim": 688,
              "max_seq_len": 512, "rope_theta": 10000.0},
    "125m": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 32000, "ffn_dim": 2048,
             "max_seq_len": 2048, "rope_theta": 10000.0},
    "1b": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_dim": 8192,
           "max_seq_len": 8192, "rope_theta": 500000.0},
    "8b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_dim": 14336,
           "max_seq_len": 8192, "rope_theta": 500000.0},
    "debug-moe": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512, "ffn_dim": 688,
                  "max_seq_len": 512, "rope_theta": 10000.0, "n_experts": 8, "top_k": 2, "moe_ffn_dim": 128,
                  "n_shared_experts": 1, "n_dense_layers": 1, "score_func": "sigmoid", "route_scale": 1.0},
    "qwen3-30b-a3b": {"dim": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4, "vocab_size": 151936,
                      "ffn_dim": 6144, "max_seq_len": 40960, "rope_theta": 1000000.0, "n_experts": 128, "top_k": 8,
                      "moe_ffn_dim": 768, "n_shared_experts": 0, "n_dense_layers": 0, "score_func": "softmax",
                      "route_scale": 1.0},
    "deepseek-v3": {"dim": 7168, "n_layers": 61, "n_heads": 128, "n_kv_heads": 128, "vocab_size": 129280,
                    "ffn_dim": 18432, "max_seq_len": 4096, "rope_theta": 10000.0, "n_experts": 256, "top_k": 8,
                    "moe_ffn_dim": 2048, "n_shared_experts": 1, "n_dense_layers": 3, "score_func": "sigmoid",
                    "route_scale": 2.5},
}  # fmt: skip


# model.size's value for a key left at 0, or at its value in UNSET (keys for which 0 means something).
PRESET = "the value of model.size"
UNSET = {"n_shared_experts": -1, "n_dense_layers": -1, "score_func": "preset"}
# The mixture-of-experts keys a size without experts leaves unset, when a config gives it experts.
MOE_DEFAULTS = {"n_shared_experts": 0, "n_dense_layers": 0, "score_func": "softmax", "route_scale": 1.0}


@dataclass
class ModelArgs:
    size: Literal["debug", "125m", "1b", "8b", "debug-moe", "qwen3-30b-a3b", "deepseek-v3"] = "debug"
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
    # Mixture of experts (moe.py): n_experts > 0 replaces the feed-forward of every block from n_dense_layers on
    # by n_experts experts of hidden size moe_ffn_dim, top_k of them per token, plus n_shared_experts experts
    # (one feed-forward of n_shared_experts x moe_ffn_dim) that every token goes through. 0: the size's value;
    # a dense size has none (n_experts 0).
    n_experts: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    top_k: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    moe_ffn_dim: int = setting(0, low=1, high=MAX_COUNT, zero=PRESET)
    n_shared_experts: int = setting(-1, low=0, high=MAX_COUNT, also=(-1,), words=f"-1 ({PRESET}) or 0 or more")
    n_dense_layers: int = setting(-1, low=0, high=4096, also=(-1,), words=f"-1 ({PRESET}) or 0 or more")
    # How a token's expert scores are computed: "softmax" over the experts (Qwen3, Mixtral) or "sigmoid" of each
    # (DeepSeek-V3); the top_k scores are then normalised to sum to 1 and multiplied by route_scale.
    score_func: Literal["preset", "softmax", "sigmoid"] = "preset"
    route_scale: float = setting(0.0, positive=True, high=100, zero=PRESET)
    # Load balancing. expert_bias_rate: the auxiliary-loss-free method (DeepSeek-V3): after each step every
    # expert's routing bias moves by this much towards the mean load (a bias only chooses experts, it does not
    # weigh their outputs); 0 = off. aux_loss_coef: the sequence-wise auxiliary loss (DeepSeek-V3's, Switch's
    # form per sequence) added to the training loss with this weight; 0 = off.
    expert_bias_rate: float = setting(1e-3, low=0, high=1)
    aux_loss_coef: float = setting(0.0, low=0, high=1)

    def __post_init__(self) -> None:
        for key, value in (SIZES[self.size] | MOE_DEFAULTS).items():
            if getattr(self, key) == UNSET.get(key, 0):
                setattr(self, key, SIZES[self.size].get(key, value))

    @property
    def moe_layers(self) -> range:
        """The indices of the blocks whose feed-forward is a mixture of experts (none without experts)."""
        return range(self.n_dense_layers, self.n_layers) if self.n_experts else range(0)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def active_parameters(self) -> int:
        """The parameters a token goes through: all of them for a dense model; with experts, top_k of the n_experts
        routed experts of each MoE block (plus the shared experts and the router, which every token uses)."""
        head_dim = self.dim // self.n_heads
        attention = self.dim * (self.n_heads + 2 * self.n_kv_heads) * head_dim + self.n_heads * head_dim * self.dim
        moe_layers = len(self.moe_layers)
        dense_mlp = (self.n_layers - moe_layers) * 3 * self.dim * self.ffn_dim
        moe_mlp = moe_layers * (3 * self.dim * self.moe_ffn_dim * (self.top_k + self.n_shared_experts))
        router = moe_layers * self.dim * self.n_experts
        norms = (2 * self.n_layers + 1) * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * attention + dense_mlp + moe_mlp + router + norms + embeddings

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x the matmul parameters a token goes through + attention scores (PaLM
        appendix B). With experts, a token goes through its top_k routed experts, the shared ones and the router:
        the active parameters, not all of them."""
        blocks = sum(self.block_flops_per_token(layer, seq_len) for layer in range(self.n_layers))
        return blocks + self.output_flops_per_token()

    def block_flops_per_token(self, layer: int, seq_len: int) -> int:
        """flops_per_token's share of block `layer`."""
        head_dim = self.dim // self.n_heads
        attention = self.dim * (self.n_heads + 2 * self.n_kv_heads) * head_dim + self.dim * self.dim
        if layer in self.moe_layers:
            active_experts = self.top_k + self.n_shared_experts
            mlp = 3 * self.dim * self.moe_ffn_dim * active_experts + self.dim * self.n_experts
        else:
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
    # Before top_k's rule: experts given to a dense size lack both, and the experts' size is the first to set.
    Rule(
        lambda c: not c.model.n_experts or c.model.moe_ffn_dim > 0,
        "model.n_experts = {c.model.n_experts} needs model.moe_ffn_dim, each expert's hidden size (size "
        "{c.model.size} has none); e.g. --model.moe_ffn_dim {c.model.ffn_dim}",
    ),
    Rule(
        lambda c: not c.model.n_experts or 1 <= c.model.top_k <= c.model.n_experts,
        "model.top_k ({c.model.top_k}) must be between 1 and model.n_experts ({c.model.n_experts}): each token goes "
        "to top_k different experts; e.g. --model.top_k {c.model.n_experts}",
    ),
    Rule(
        lambda c: not c.model.n_experts or c.model.n_dense_layers < c.model.n_layers,
        "model.n_dense_layers ({c.model.n_dense_layers}) leaves none of the {c.model.n_layers} blocks a mixture of "
        "experts; choose fewer, e.g. --model.n_dense_layers 0",
    ),
]
