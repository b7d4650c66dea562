"""The tokenizer named by data.tokenizer: text to token ids (scripts/prepare_data.py) and back (scripts/generate.py).

data.tokenizer is a folder or hub id that AutoTokenizer loads, or a bare `tokenizer.json` (its path, or a folder
holding it without a tokenizer_config.json); "" (the default) is the model's own, model.path.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# The end-of-document token, the first of these names the vocabulary has: GPT-2 and Qwen, Llama 3, Llama 2 and
# Mistral, Gemma, BERT-style tokenizers. A tokenizer with none of them is refused (a document boundary is needed).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")

# What any text data needs of a tokenizer, checked before anything is tokenized or written (check_usable): more
# tokens than this, and this text back from its ids (compared without case and spaces, which some tokenizers
# normalise: BERT-style ones lowercase, SentencePiece ones move spaces).
MIN_VOCAB = 32
SAMPLE = "The quick brown fox jumps over the lazy dog: 0123456789 times, (twice)!"


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
        self.check_usable()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # A fast (Rust) tokenizer encodes a batch on all CPU cores.
        return self.backend(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def check_usable(self) -> None:
        """A vocabulary, and text that comes back from its ids: a tokenizer without them (e.g. the empty one of a
        model folder whose tokenizer files are missing) would turn any text into nothing but end-of-text ids."""
        ids = self.encode(SAMPLE)
        back = self.decode(ids)
        if self.vocab_size < MIN_VOCAB or "".join(back.split()).casefold() != "".join(SAMPLE.split()).casefold():
            raise TokenizerError(
                f"the tokenizer {self.source} is not usable: it has {self.vocab_size} token(s), and {SAMPLE[:19]!r}... "
                f"becomes {len(ids)} id(s) that decode to {back[:19]!r}; its tokenizer files are missing or empty: "
                "give data.tokenizer (or --tokenizer) a complete tokenizer"
            )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer in a folder or hub repository (AutoTokenizer), or a bare `tokenizer.json` (its path, or a
    folder holding only it, as the `tokenizers` library saves one), as a Tokenizer."""
    path = Path(spec).expanduser()
    bare = path / "tokenizer.json" if path.is_dir() and not (path / "tokenizer_config.json").exists() else path
    try:
        if bare.is_file():
            return bare_tokenizer(bare, spec)
        return Tokenizer(AutoTokenizer.from_pretrained(spec), spec)
    except TokenizerError:
        raise
    except Exception as exc:  # whatever transformers raises: no such folder, no tokenizer files, no network
        reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise TokenizerError(
            f"data.tokenizer {spec} cannot be loaded ({reason}); give a folder or hub id with a tokenizer, or a "
            "tokenizer.json"
        ) from None


def bare_tokenizer(path: Path, spec: str) -> Tokenizer:
    """A tokenizer.json without the tokenizer_config.json that names its special tokens: the end-of-text token is
    the first of EOS_NAMES in its vocabulary."""
    backend = PreTrainedTokenizerFast(tokenizer_file=str(path))
    vocab = backend.get_vocab()
    eos = next((name for name in EOS_NAMES if name in vocab), None)
    if eos is None:
        raise TokenizerError(
            f"{spec} has none of the end-of-text tokens {', '.join(EOS_NAMES)}; add one when training the "
            "tokenizer (special_tokens=['<|endoftext|>']), or give its folder with a tokenizer_config.json"
        )
    backend.eos_token = eos
    return Tokenizer(backend, spec)
