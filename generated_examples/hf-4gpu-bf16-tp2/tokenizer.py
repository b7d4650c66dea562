"""The tokenizer named by data.tokenizer: text to token ids (scripts/prepare_data.py) and back (scripts/generate.py).

data.tokenizer is a folder or hub id that AutoTokenizer loads; "" (the default) is the model's own, model.path.
"""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class TokenizerError(ValueError):
    """data.tokenizer cannot be loaded or used; the message names it and the fix."""


class Tokenizer:
    """Text <-> token ids. Special tokens are never added: documents are separated by `eos_id` only."""

    def __init__(self, backend: PreTrainedTokenizerBase, source: str) -> None:
        if backend.eos_token_id is None:
            raise TokenizerError(
                f"the tokenizer of {source} has no end-of-text token; set data.tokenizer to one that has"
            )
        self.backend, self.source = backend, source
        self.eos_id: int = backend.eos_token_id
        self.vocab_size: int = len(backend)  # added tokens included

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # A fast (Rust) tokenizer encodes a batch on all CPU cores.
        return self.backend(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer in a folder or hub repository (AutoTokenizer), as a Tokenizer."""
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(spec), spec)
    except TokenizerError:
        raise
    except Exception as exc:  # whatever transformers raises: no such folder, no tokenizer files, no network
        reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise TokenizerError(
            f"data.tokenizer {spec} cannot be loaded ({reason}); give a folder or hub id with a tokenizer"
        ) from None
