"""Token data, addressed by global sample index.

A step reads samples [step * global_batch_size, (step + 1) * global_batch_size),
and each rank takes a contiguous slice of that window. The samples a step sees
therefore do not depend on the number of ranks, and the position in the data
is fully described by the step, which makes resuming exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

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
    A sample is its token ids, or, with `documents`, rows (tokens, target mask, document starts) as micro_batches
    reads them: the mask is all 1 (every token is a target), the starts row 1 where a token begins a document.
    """

    def __init__(self, folder: str | Path, split: str, seq_len: int, documents: bool = False) -> None:
        index = read_index(folder)
        self.seq_len = seq_len
        shards = [shard for shard in index[split] if shard["tokens"] > seq_len]
        self.shards = [np.memmap(Path(folder) / shard["file"], dtype=index["dtype"], mode="r") for shard in shards]
        # data.document_mask: each shard's .docs file, the ascending offsets of the tokens that begin a document.
        self.docs = [read_docs(Path(folder) / shard["docs_file"]) for shard in shards] if documents else []
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
        tokens = self.shards[shard][window]
        if not self.docs:
            return tokens
        rows = [tokens, np.ones_like(tokens)]
        if self.docs:
            docs = self.docs[shard]
            starts = np.zeros_like(tokens)
            starts[docs[np.searchsorted(docs, window.start) : np.searchsorted(docs, window.stop)] - start] = 1
            rows.append(starts)
        return np.stack(rows)  # (tokens, target mask[, document starts])


def read_docs(path: Path) -> np.ndarray:
    """A shard's .docs file (int64 offsets), memory-mapped; empty when no document begins in the shard."""
    return np.memmap(path, dtype=np.int64, mode="r") if path.stat().st_size else np.empty(0, np.int64)


def open_tokens(
    path: str | Path, split: str, seq_len: int, vocab_size: int, documents: bool = False
) -> TokenFile | TokenShards:
    """data.path as samples: a prepared folder's `split`, or a flat token file (which has a training split only).
    `documents` (data.document_mask): samples carry where documents start (preflight.py refused data without)."""
    if Path(path).is_dir():
        return TokenShards(path, split, seq_len, documents)
    if split != "train":
        raise ValueError(f"{path} is a flat token file: it has no {split} split")
    return TokenFile(path, seq_len, vocab_size)


def describe_data(path: str, samples: TokenFile | TokenShards) -> str:
    """data.path as train.py's data line names it."""
    return path


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


class MicroBatch(NamedTuple):
    """One micro-batch: model.py's loss(model, *batch) arguments, in its order. Each (batch, seq) int64."""

    inputs: torch.Tensor
    targets: torch.Tensor  # the next token of each input, or IGNORE where the loss skips it
    # Each token's rotary position, restarting at 0 at every document start (and at the window start); None
    # without document masking (then 0..seq-1).
    positions: torch.Tensor | None = None
    # The running count of document starts: a token attends only to earlier tokens of the same id. None: one
    # document per row, plain causal attention.
    document_ids: torch.Tensor | None = None

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(*(None if t is None else t.to(device, non_blocking=True) for t in self))


def micro_batches(
    samples: ShuffledEpochs | TokenShards | SyntheticTokens,
    step: int,
    global_batch_size: int,
    grad_accum_steps: int,
    rank: int,
    world_size: int,
) -> list[MicroBatch]:
    """This rank's micro-batches for optimizer step `step` (0-based)."""
    per_rank = global_batch_size // world_size
    micro = per_rank // grad_accum_steps
    first = step * global_batch_size + rank * per_rank
    batches = []
    for m in range(grad_accum_steps):
        rows = np.stack([samples[first + m * micro + i] for i in range(micro)]).astype(np.int64)
        if rows.ndim == 2:
            tokens = torch.from_numpy(rows)
            batches.append(MicroBatch(tokens[:, :-1], tokens[:, 1:]))
            continue
        # Chat samples: a target whose mask is 0 (a prompt token) becomes IGNORE, which the loss skips.
        tokens, mask = rows[:, 0], rows[:, 1]
        targets = np.where(mask[:, 1:] == 1, tokens[:, 1:], IGNORE)
        if rows.shape[1] == 2:
            batches.append(MicroBatch(torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets)))
            continue
        positions, document_ids = document_positions(rows[:, 2, :-1])
        # A document's last token would be asked for the next document's first, which nothing it may attend to
        # predicts: IGNORE (as transformers' DataCollatorWithFlattening does).
        targets = np.where(rows[:, 2, 1:] == 1, IGNORE, targets)
        batches.append(MicroBatch(*(torch.from_numpy(a) for a in (tokens[:, :-1], targets, positions, document_ids))))
    return batches


def document_positions(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, document_ids) of (batch, seq) document-start flags: each row's first token starts a document
    (the part of one that began before the window), positions count from 0 at each start, and the ids count the
    starts so far (1 for the window's first document)."""
    starts = starts.copy()
    starts[:, 0] = 1
    index = np.broadcast_to(np.arange(starts.shape[1]), starts.shape)
    last_start = np.maximum.accumulate(np.where(starts == 1, index, 0), axis=1)
    return index - last_start, np.cumsum(starts, axis=1)


# ---- The checks preflight.py runs on data.path before a run (each mistake: one line naming it and the fix) ----

SCAN_TOKENS = 1 << 24  # token ids checked per read of data.path: 32-64 MiB at a time, whatever the file size


class DataError(Exception):
    """data.path cannot feed the run: the message is one line that names why and the fix."""


def check_token_data(path: Path, seq_len: int, vocab_size: int, val_samples: int, documents: bool = False) -> None:
    """data.path (a prepared folder or a flat token file) holds enough valid samples for the run, and
    `val_samples` validation samples (0: no validation); with `documents` (data.document_mask), where each
    document starts."""
    if path.is_dir():
        check_prepared_folder(path, seq_len, vocab_size, documents)
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
    if documents:
        raise DataError(
            f"data.path {path} is a flat token file, which does not record where documents start, so "
            "data.document_mask cannot keep them apart; prepare a folder with scripts/prepare_data.py, or pass "
            "--data.document_mask false"
        )


def check_prepared_folder(path: Path, seq_len: int, vocab_size: int, documents: bool = False) -> None:
    """A folder written by scripts/prepare_data.py: finished, plain text (no loss masks), for this vocabulary, every
    shard whole. `documents`: every shard has a .docs file of ascending offsets within it."""
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
    if index.get("masks"):
        raise DataError(
            f"data.path {path} holds chat data with a loss mask, which only a project generated with --task sft "
            "trains on; prepare plain text with scripts/prepare_data.py"
        )
    if documents and not index.get("documents"):
        raise DataError(
            f"data.path {path} was prepared without document starts (an older scripts/prepare_data.py), so "
            f"data.document_mask cannot keep its documents apart; {fix}, or pass --data.document_mask false"
        )
    if vocabulary > vocab_size:
        raise DataError(
            f"data.path {path} was tokenized with a vocabulary of {vocabulary} tokens ({index.get('tokenizer')}), "
            f"but model.vocab_size is {vocab_size}; prepare the data with the model's tokenizer"
        )
    for shard in index["train"] + index["val"] if documents else []:
        check_docs(path, shard, fix)
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


def check_docs(path: Path, shard: dict, fix: str) -> None:
    """A shard's .docs file: int64 offsets, ascending, each within the shard (read whole: 8 bytes a document)."""
    docs, tokens = path / str(shard.get("docs_file", f"{shard['file']}.docs")), shard["tokens"]
    if not docs.is_file():
        raise DataError(f"data.path {path}: {docs.name}, where {shard['file']}'s documents start, is missing; {fix}")
    offsets = read_docs(docs) if docs.stat().st_size % 8 == 0 else np.array([-1])
    if np.any(np.diff(offsets) <= 0) or (len(offsets) and not 0 <= offsets[0] <= offsets[-1] < tokens):
        raise DataError(
            f"data.path {path}: {docs.name} is not ascending int64 offsets within its shard of {tokens} tokens "
            f"(it is damaged or belongs to another shard); {fix}"
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
