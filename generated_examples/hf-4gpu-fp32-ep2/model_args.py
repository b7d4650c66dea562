"""The Hugging Face model's settings (the [model] section of config.toml): where its folder is, and whether its
weights are loaded. No torch or transformers at import, so that reading a config (config.py, preflight.py, the
data scripts) starts fast: the properties that need them import them. model.py builds the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from schema import Rule, setting

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The files of a hub model that training, scripts/export.py and scripts/prepare_data.py read.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]

# Model settings a resume may change (preflight.py compares the others with the checkpoint): how the
# weights were first filled no longer matters once they are trained.
RESUME_MAY_CHANGE = ("pretrained",)

# The rules between the model's keys: none beyond path's bounds (transformers checks the shapes in config.json).
MODEL_RULES: list[Rule] = []


@dataclass
class ModelArgs:
    # A local folder with config.json and *.safetensors, or a hub id. Bounds: schema.py; the model's own shapes
    # are checked by transformers when preflight.py loads its config.
    path: str = setting("", nonempty="set it to a model folder (config.json + *.safetensors) or a hub id")
    pretrained: bool = True  # false: the model's own random initialisation instead of the weights

    # huggingface_hub, transformers and torch are imported where they are needed, not when a config is read.

    @cached_property
    def folder(self) -> Path:
        """The model's local folder: `path` itself, or the hub's download of it (HF_HUB_OFFLINE=1: cache only)."""
        local = Path(self.path).expanduser()
        if local.is_dir():
            return local
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(self.path, allow_patterns=HUB_FILES))

    @cached_property
    def hf_config(self) -> PretrainedConfig:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_seq_len(self) -> int:
        # Models without a position limit (none in config.json) accept any length.
        return getattr(self.hf_config, "max_position_embeddings", None) or 2**31

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x matmul parameters (of a mixture-of-experts model, the active ones) +
        attention scores (PaLM appendix B)."""
        import torch
        from torch import nn
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config)
        config = self.hf_config
        # A mixture-of-experts model's fused experts (3-D: experts x out x in): a token passes through
        # num_experts_per_tok of them, so only that share of their weights multiplies its activations.
        top_k = getattr(config, "num_experts_per_tok", None)
        # Every 2-D weight outside the embeddings multiplies activations (the output layer too, even when
        # it is tied to the input embedding).
        matmul_params = sum(
            param.numel() if param.ndim == 2 else param.numel() * top_k // param.shape[0]
            for module in model.modules()
            if not isinstance(module, nn.Embedding)
            for param in module.parameters(recurse=False)
            if param.ndim == 2 or (param.ndim == 3 and top_k)
        )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 6 * matmul_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
