"""Token data, addressed by global sample index.

A step reads samples [step * global_batch_size, (step + 1) * global_batch_size),
and each rank takes a contiguous slice of that window. The samples a step sees
therefore do not depend on the number of ranks, and the position in the data
is fully described by the step, which makes resuming exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


class SyntheticTokens:
    """A learnable synthetic stream: each sample counts up from a random start with a random stride.

    Deterministic in (seed, sample index); the next token is predictable from
    the previous two, so the loss visibly drops within a few steps.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.num_samples, self.seed = vocab_size, seq_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        start = rng.integers(self.vocab_size)
        stride = rng.integers(1, 8)
        return (start + stride * np.arange(self.seq_len + 1)) % self.vocab_size


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 token ids (nanoGPT format) while they fit, uint32 for larger vocabularies."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


class TokenFile:
    """Non-overlapping windows of a flat binary file of token ids (`token_dtype`), memory-mapped."""

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int) -> None:
        self.tokens = np.memmap(path, dtype=token_dtype(vocab_size), mode="r")
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        # preflight.py checked the file before the run: its size, its length, and that every id < vocab_size.

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


INDEX_FILE = "index.json"  # what scripts/prepare_data.py writes next to its shards
IGNORE = -100  # the target of a token the loss skips (F.cross_entropy's default ignore_index)


def read_index(folder: str | Path) -> dict:
    """The index of a folder written by scripts/prepare_data.py (preflight.py checked it against the shards)."""
    return json.loads((Path(folder) / INDEX_FILE).read_text())


class TokenShards:
    """The samples of one split ("train" or "val") of a prepared folder: many shard files, memory-mapped.

    Sample i is the i-th window of seq_len + 1 tokens counted across the shards in order (a window never
    spans two shards), so a sample index names the same tokens on any number of ranks, as with TokenFile.
    """

    def __init__(self, folder: str | Path, split: str, seq_len: int) -> None:
        index = read_index(folder)
        self.seq_len = seq_len
        shards = [shard for shard in index[split] if shard["tokens"] > seq_len]
        self.shards = [np.memmap(Path(folder) / shard["file"], dtype=index["dtype"], mode="r") for shard in shards]
        # Chat data (scripts/prepare_chat.py): a mask per token, 1 where the token is a target of the loss.
        self.masks = [np.memmap(Path(folder) / shard["mask_file"], dtype=np.uint8, mode="r") for shard in shards
                      if "mask_file" in shard]  # fmt: skip
        windows = [(len(tokens) - 1) // seq_len for tokens in self.shards]
        # starts[k]: the index of shard k's first sample.
        self.starts = np.cumsum([0, *windows])
        self.num_samples = int(self.starts[-1])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        start = (index - int(self.starts[shard])) * self.seq_len
        window = slice(start, start + self.seq_len + 1)
        if self.masks:
            return np.stack([self.shards[shard][window], self.masks[shard][window]])  # (tokens, target mask)
        return self.shards[shard][window]


def open_tokens(path: str | Path, split: str, seq_len: int, vocab_size: int) -> TokenFile | TokenShards:
    """data.path as samples: a prepared folder's `split`, or a flat token file (which has a training split only)."""
    if Path(path).is_dir():
        return TokenShards(path, split, seq_len)
    if split != "train":
        raise ValueError(f"{path} is a flat token file: it has no {split} split")
    return TokenFile(path, seq_len, vocab_size)


class ShuffledEpochs:
    """Visit the samples of `dataset` in a new seeded order every epoch, forever."""

    def __init__(self, dataset: SyntheticTokens | TokenFile | TokenShards, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def __getitem__(self, position: int) -> np.ndarray:
        epoch, offset = divmod(position, len(self.dataset))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        return self.dataset[int(self._order[offset])]


def micro_batches(
    samples: ShuffledEpochs | TokenShards | SyntheticTokens,
    step: int,
    global_batch_size: int,
    grad_accum_steps: int,
    rank: int,
    world_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) micro-batches for optimizer step `step` (0-based)."""
    per_rank = global_batch_size // world_size
    micro = per_rank // grad_accum_steps
    first = step * global_batch_size + rank * per_rank
    batches = []
    for m in range(grad_accum_steps):
        rows = np.stack([samples[first + m * micro + i] for i in range(micro)]).astype(np.int64)
        if rows.ndim == 3:
            # Chat samples: a target whose mask is 0 (a prompt token) becomes IGNORE, which the loss skips.
            tokens, mask = rows[:, 0], rows[:, 1]
            targets = np.where(mask[:, 1:] == 1, tokens[:, 1:], IGNORE)
            batches.append((torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets)))
            continue
        tokens = torch.from_numpy(rows)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


# ---- The checks preflight.py runs on data.path before a run (each mistake: one line naming it and the fix) ----

SCAN_TOKENS = 1 << 24  # token ids checked per read of data.path: 32-64 MiB at a time, whatever the file size


class DataError(Exception):
    """data.path cannot feed the run: the message is one line that names why and the fix."""


def check_token_data(path: Path, seq_len: int, vocab_size: int, val_samples: int, chat: bool) -> None:
    """data.path (a prepared folder or a flat token file) holds enough valid samples for the run, and
    `val_samples` validation samples (0: no validation)."""
    if path.is_dir():
        check_prepared_folder(path, seq_len, vocab_size, chat)
        found = len(TokenShards(path, "val", seq_len)) if val_samples else 0
        if found < val_samples:
            raise DataError(
                f"data.path {path} has {found} validation samples of training.seq_len + 1 tokens, fewer than "
                f"eval.batches x training.global_batch_size = {val_samples}; lower --eval.batches, prepare with a "
                "larger --val-fraction, or set --eval.every 0"
            )
        return
    check_token_file(path, seq_len, vocab_size)
    if val_samples:
        raise DataError(
            f"data.path {path} is a flat token file, which has no validation split; prepare a folder with "
            "scripts/prepare_data.py, or set --eval.every 0"
        )


def check_prepared_folder(path: Path, seq_len: int, vocab_size: int, chat: bool) -> None:
    """A folder written by scripts/prepare_data.py: finished, for this vocabulary, every shard whole. `chat`: the
    project trains on chat data (--task sft), whose shards have a loss mask each; others refuse masked data."""
    fix = f"prepare it again with scripts/prepare_data.py --output {path}-new and point --data.path there"
    if not (path / INDEX_FILE).is_file():
        raise DataError(
            f"data.path {path} is a folder without {INDEX_FILE}; give a folder written by scripts/prepare_data.py "
            "(or a flat token file)"
        )
    try:
        index = read_index(path)
        splits = {split: [(shard["file"], int(shard["tokens"]), int(shard["max_id"])) for shard in index[split]]
                  for split in ("train", "val")}  # fmt: skip
        dtype, vocabulary, complete = np.dtype(index["dtype"]), int(index["vocab_size"]), index["complete"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"data.path {path}/{INDEX_FILE} cannot be read ({type(exc).__name__}: {exc}); {fix}") from None
    if not complete:
        raise DataError(
            f"data.path {path} is not finished: scripts/prepare_data.py stopped before the end; run it again with "
            "the same arguments to finish it"
        )
    if index.get("masks") and not chat:
        raise DataError(
            f"data.path {path} holds chat data with a loss mask (scripts/prepare_chat.py), which a --task sft "
            "project trains on; prepare plain text with scripts/prepare_data.py"
        )
    if vocabulary > vocab_size:
        raise DataError(
            f"data.path {path} was tokenized with a vocabulary of {vocabulary} tokens ({index.get('tokenizer')}), "
            f"but model.vocab_size is {vocab_size}; prepare the data with the model's tokenizer"
        )
    for shard in index["train"] + index["val"] if chat else []:
        mask = path / shard.get("mask_file", "")
        if "mask_file" in shard and (not mask.is_file() or mask.stat().st_size != shard["tokens"]):
            raise DataError(f"data.path {path}: {mask.name} is missing or not one byte per token; {fix}")
    for file, tokens, largest in splits["train"] + splits["val"]:
        shard = path / file
        if not shard.is_file():
            raise DataError(f"data.path {path}: shard {file} is missing; {fix}")
        size = shard.stat().st_size
        if size != tokens * dtype.itemsize:
            raise DataError(
                f"data.path {path}: shard {file} has {size} bytes, but index.json says {tokens} {dtype.name} token "
                f"ids ({tokens * dtype.itemsize} bytes); it is truncated or was replaced; {fix}"
            )
        if largest >= vocab_size:
            raise DataError(
                f"data.path {path}: shard {file} holds token id {largest} >= model.vocab_size {vocab_size}; "
                "prepare the data with the model's tokenizer"
            )
        # index.json's max_id is what the shard held when written: a shard changed since (a bad copy, flipped
        # bits) may hold more. Its ids are read, as in check_token_file (~1 s per GiB of shards, once per launch).
        actual, position = largest_id(np.memmap(shard, dtype=dtype, mode="r") if size else np.empty(0, dtype), largest)
        if actual > largest:
            raise DataError(
                f"data.path {path}: shard {file} holds token id {actual} (at token {position}), above the largest "
                f"id {largest} that index.json records for it: it was changed after it was written; {fix}"
            )
    if len(TokenShards(path, "train", seq_len)) == 0:
        raise DataError(
            f"data.path {path} holds no training sample of training.seq_len + 1 = {seq_len + 1} tokens; give it "
            "more text or a shorter --training.seq_len"
        )


def check_token_file(path: Path, seq_len: int, vocab_size: int) -> None:
    """data.path: a flat file of token ids that all fit the model's vocabulary, long enough for one sample."""
    dtype = np.dtype(token_dtype(vocab_size))
    fix = (
        "point --data.path at a folder written by scripts/prepare_data.py or a flat file of token ids, or set "
        "--data.path '' for synthetic tokens"
    )
    if not path.exists():
        raise DataError(f"data.path {path} does not exist; {fix}")
    if not path.is_file():
        raise DataError(f"data.path {path} is not a file; {fix}")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"data.path {path} has {size} bytes, not a whole number of {dtype.name} token ids ({dtype.itemsize} "
            f"bytes each for model.vocab_size {vocab_size}); it was written for another vocabulary or is truncated"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype)
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"data.path {path} holds {len(tokens)} tokens, fewer than training.seq_len + 1 = {seq_len + 1}; "
            "give it more data or a shorter --training.seq_len"
        )
    # Every id, not a sample: an id >= vocab_size fails inside the embedding (on a GPU, a device-side assert
    # that names nothing).
    largest, position = largest_id(tokens, vocab_size - 1)
    if largest >= vocab_size:
        raise DataError(
            f"data.path {path} holds token id {largest} >= model.vocab_size {vocab_size} (first at token "
            f"{position}); tokenize it with the model's tokenizer"
        )


def largest_id(tokens: np.ndarray, limit: int) -> tuple[int, int]:
    """The largest id of `tokens` (a memmap) and where the first id above `limit` is (-1: none), stopping at the
    chunk that holds one. Reading in chunks keeps memory flat for files of any size (~1 s per GiB)."""
    largest = 0
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        largest = max(largest, int(chunk.max()))
        if largest > limit:
            return largest, start + int(np.argmax(chunk > limit))
    return largest, -1
