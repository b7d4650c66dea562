"""The tokenizer named by data.tokenizer: text to token ids (scripts/prepare_data.py) and back (scripts/generate.py).

data.tokenizer is a Hugging Face `tokenizer.json` (the `tokenizers` library's format, which most open models
ship): its path, a folder that holds one, or a hub id whose repository does (downloaded once into the Hugging
Face cache; HF_HUB_OFFLINE=1 then loads it with no network). model.vocab_size follows its vocabulary unless the
config sets it.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import hf_hub_download
from tokenizers import Tokenizer as RustTokenizer

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

    def __init__(self, backend: RustTokenizer, source: str) -> None:
        vocab = backend.get_vocab(with_added_tokens=True)
        eos = next((name for name in EOS_NAMES if name in vocab), None)
        if eos is None:
            raise TokenizerError(
                f"{source} has none of the end-of-text tokens {', '.join(EOS_NAMES)}; add one when training the "
                "tokenizer (special_tokens=['<|endoftext|>'])"
            )
        self.backend, self.source = backend, source
        self.eos_id: int = vocab[eos]
        # The largest id + 1: added tokens can sit above the base vocabulary.
        self.vocab_size: int = max(vocab.values()) + 1
        self.check_usable()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch runs on all CPU cores (Rust threads; TOKENIZERS_PARALLELISM=false turns that off).
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

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
    """The tokenizer.json at `spec` (a file, a folder holding one, or a hub id), as a Tokenizer."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    elif not path.exists() and not spec.startswith((".", "/", "~")) and not spec.endswith(".json"):
        # Not a path: a hub id (owner/name or name), fetched once into the Hugging Face cache.
        try:
            path = Path(hf_hub_download(spec, "tokenizer.json"))
        except Exception as exc:  # not on the hub, no network (HF_HUB_OFFLINE=1 and not cached), gated
            reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise TokenizerError(f"data.tokenizer {spec}: no tokenizer.json could be fetched ({reason})") from None
    if not path.is_file():
        raise TokenizerError(
            f"data.tokenizer {spec}: {path} does not exist; give a tokenizer.json, its folder, or a hub id"
        )
    try:
        backend = RustTokenizer.from_file(str(path))
    except Exception as exc:  # not JSON, or not a tokenizers file
        reason = " ".join(str(exc).split())[:200]
        raise TokenizerError(f"data.tokenizer {spec}: {path} is not a tokenizers tokenizer.json ({reason})") from None
    return Tokenizer(backend, spec)
