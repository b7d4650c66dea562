"""The llama family's model shapes `fsdp2gen plan` knows: the template's own, read from its model_args.py, and the
larger published Llama 3 shapes the template does not offer.

model_args.py's `SIZES` (the `model.size` presets) and `ModelArgs` defaults are read with ast from the file the
wheel ships (it imports the project's schema.py, which the generator does not have), so they are written down in one
place only.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from fsdp2gen import questions

# The llama family's model_args.py in the template (a file-name conditional: only family llama renders it), a
# Jinja template: a dense project's has no mixture-of-experts keys. Read as rendered with --moe, which has them all.
LLAMA_MODEL = Path("project") / '{% if family == "llama" %}model_args.py{% endif %}.jinja'
LLAMA3_VOCAB = 128256


@dataclass(frozen=True)
class LlamaShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = LLAMA3_VOCAB
    max_seq_len: int = 8192
    tie_embeddings: bool = False  # the output layer reuses the embedding matrix: one vocab x dim matrix fewer
    # Mixture of experts (the template's moe.py; 0 experts: dense): blocks n_dense_layers.. route each token to
    # top_k of n_experts experts of hidden size moe_ffn_dim, plus n_shared_experts x moe_ffn_dim shared hidden units.
    n_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def moe_layers(self) -> range:
        """The blocks whose feed-forward is a mixture of experts (model_args.py's ModelArgs.moe_layers)."""
        return range(self.n_dense_layers, self.n_layers) if self.n_experts else range(0)


# Llama 3 (70b), 3.1 (405b) and 3.2 (3b) shapes that model.size does not offer, untied: 3b carries one more
# vocab x dim matrix than Meta's checkpoint, which ties the output layer to the embedding.
PUBLISHED = {
    "3b": LlamaShape(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    "70b": LlamaShape(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405b": LlamaShape(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}


@cache
def _template_model() -> ast.Module:
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True).from_string(
        (questions.template_dir() / LLAMA_MODEL).read_text(encoding="utf-8")
    )
    return ast.parse(template.render(moe=True, pp=1, tp=1, cp=1))


def template_sizes() -> dict[str, dict[str, Any]]:
    """model_args.py's SIZES: {model.size: {ModelArgs field: value}}, in the template's order."""
    for node in _template_model().body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["SIZES"]:
            return ast.literal_eval(node.value)
    raise LookupError(f"no SIZES in the template's {LLAMA_MODEL}")


def template_unset() -> dict[str, Any]:
    """model_args.py's UNSET: the keys whose "take model.size's value" is not 0 (0 is one of their values)."""
    for node in _template_model().body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["UNSET"]:
            return ast.literal_eval(node.value)
    raise LookupError(f"no UNSET in the template's {LLAMA_MODEL}")


def template_model_defaults() -> dict[str, Any]:
    """model_args.py's ModelArgs defaults, in field order: what a config.toml's [model] leaves out."""
    for node in _template_model().body:
        if isinstance(node, ast.ClassDef) and node.name == "ModelArgs":
            return {
                field.target.id: ast.literal_eval(field_default(field.value))
                for field in node.body
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and field.value is not None
            }
    raise LookupError(f"no ModelArgs in the template's {LLAMA_MODEL}")


def field_default(value: ast.expr) -> ast.expr:
    """A field's default: `value` itself, or the first argument of `setting(default, bounds...)` (schema.py)."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "setting":
        return value.args[0]
    return value


def shape_of(keys: dict[str, Any]) -> LlamaShape:
    """The shape of ModelArgs-like `keys` (rope_theta, norm_eps and the like do not change the memory)."""
    return LlamaShape(**{field.name: keys[field.name] for field in fields(LlamaShape) if field.name in keys})


@cache
def sizes() -> dict[str, LlamaShape]:
    """Every size `plan --size` takes, narrowest first: model.size's names and the published shapes, the dense ones,
    then the mixture-of-experts ones."""
    found = {name: shape_of(keys) for name, keys in template_sizes().items()} | PUBLISHED
    return dict(sorted(found.items(), key=lambda item: (item[1].n_experts > 0, item[1].dim, item[1].n_layers)))
