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
