"""Tokenize a text corpus into the token shards train.py reads (data.path), with a validation split.

    python scripts/prepare_data.py corpus/ --output data/corpus          # then: --data.path data/corpus
    python scripts/prepare_data.py a.txt b.jsonl c.parquet --output data/mix --val-fraction 0.01

Inputs: text files (.txt, .md: one document each), JSON lines (.jsonl, .json: one document per line, in the
--text-field), Parquet files (the --text-field column; needs pyarrow), a folder written by `datasets`'
save_to_disk (its train split; needs datasets: pip install -e '.[data]'), or a folder of such files.
The tokenizer is data.tokenizer ("" = the model's own, model.path), or --tokenizer.

Documents are tokenized in batches on all CPU cores (the tokenizer's Rust threads), each followed by the
end-of-text token, and written as shards of uint16 ids (uint32 for vocabularies over 65536), each with the offsets
of its documents' first tokens (.docs), plus index.json.
Text is read in pieces of ~8 KiB, so no file is held in memory whole; every round(1 / val_fraction)-th piece
goes to the validation split. An interrupted run resumes where its last finished shard ended when started
again with the same arguments; a finished folder is left as it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from config import ConfigError, load_config  # noqa: E402
from data import INDEX_FILE, token_dtype  # noqa: E402
from tokenizer import Tokenizer, TokenizerError, load_tokenizer  # noqa: E402

USAGE_ERROR = 2
FORMAT = "fsdp2gen-tokens/1"
TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
SUFFIXES = (*TEXT_SUFFIXES, *JSON_SUFFIXES, ".parquet")
PIECE_BYTES = 8 << 10  # text is cut into pieces of about this size, at line ends: the unit of the val split
BATCH_BYTES = 8 << 20  # pieces tokenized together: large enough to keep every core busy, small enough for memory


class DataError(Exception):
    """A mistake in the inputs or arguments: one line naming it and the fix."""


def main() -> None:
    parser = argparse.ArgumentParser(description="Tokenize text into token shards for data.path.")
    parser.add_argument("inputs", nargs="+", type=Path, help="text/JSONL/Parquet files, datasets folders, or folders")
    parser.add_argument("--output", type=Path, required=True, help="a new (or empty) folder for the shards")
    parser.add_argument("--tokenizer", default=None, help="default: data.tokenizer in --config")
    parser.add_argument("--text-field", default="text", help="the text of a JSON line or a column (default: text)")
    parser.add_argument("--val-fraction", type=float, default=0.005, help="of the text (default: %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default: 1e8)")
    parser.add_argument("--config", type=Path, default=PROJECT / "config.toml", help="default: %(default)s")
    run(prepare, parser)


def run(prepare: Callable[[argparse.Namespace], None], parser: argparse.ArgumentParser) -> None:
    """prepare(the parsed arguments); a mistake in the input exits with one line and USAGE_ERROR."""
    args = parser.parse_args()
    try:
        if not 0 <= args.val_fraction < 1:
            raise DataError(f"--val-fraction must be at least 0 and below 1, got {args.val_fraction}")
        if args.shard_tokens < 1:
            raise DataError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
        prepare(args)
    except (DataError, TokenizerError, ConfigError) as exc:
        parser.exit(USAGE_ERROR, f"{parser.prog}: error: {exc}\n")
    except ValueError as exc:  # the config's own checks (config.py raises ValueError for a bad value)
        parser.exit(USAGE_ERROR, f"{parser.prog}: error: {args.config}: {exc}\n")


def prepare(args: argparse.Namespace) -> None:
    config = load_config(args.config)
    spec = args.tokenizer or config.data.tokenizer or config.model.path
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise DataError(
            f"the tokenizer {spec} has {tokenizer.vocab_size} tokens but model.vocab_size is "
            f"{config.model.vocab_size}: its ids would not fit the embedding; use the model's tokenizer or a "
            "larger model.vocab_size"
        )
    check_output(args.output)
    files = input_files(args.inputs, args.output)
    settings = {
        "inputs": [describe(path) for path in files],
        "tokenizer": str(spec),
        "text_field": args.text_field,
        "val_fraction": args.val_fraction,
        "shard_tokens": args.shard_tokens,
    }
    created = not args.output.exists()
    index = start_index(args.output, settings, tokenizer)
    try:
        tokenize(args, files, tokenizer, index)
    except DataError:
        if created:
            # Only this run's own files are in a folder it created: leave nothing half-written behind.
            shutil.rmtree(args.output)
        raise


def tokenize(args: argparse.Namespace, files: list[Path], tokenizer: Tokenizer, index: dict) -> None:
    if index["complete"]:
        print(f"{args.output} is already prepared ({count(index, 'train'):,} training tokens); nothing to do")
        return
    writer = ShardWriter(args.output, index)
    every = round(1 / args.val_fraction) if args.val_fraction else 0
    done = index["pieces_done"]
    started, text_bytes = time.perf_counter(), 0
    with tqdm(total=sum(path.stat().st_size for path in files), unit="B", unit_scale=True, desc="tokenizing") as bar:
        batch: list[tuple[int, str, bool, bool]] = []  # (piece number, text, ends a document, validation)
        batch_bytes, total = 0, 0
        for number, (text, ends_document, size) in enumerate(pieces(files, args.text_field)):
            bar.update(size)
            total = number + 1
            if number < done:
                continue  # tokenized by the interrupted run, in a finished shard
            batch.append((number, text, ends_document, every > 0 and (number + 1) % every == 0))
            batch_bytes += len(text)
            if batch_bytes >= BATCH_BYTES:
                writer.write(batch, tokenizer)
                text_bytes += batch_bytes
                batch, batch_bytes = [], 0
        writer.write(batch, tokenizer)
        text_bytes += batch_bytes
    # Everything read: pieces_done counts every piece, so that running again after a refusal below adds nothing.
    writer.close_all(total)
    elapsed = time.perf_counter() - started
    if count(index, "train") == 0:
        raise DataError(f"the inputs hold no text ({', '.join(map(str, args.inputs))}); give files with text")
    if every and count(index, "val") == 0:
        raise DataError(
            f"no text went to the validation split (the corpus has fewer than {every} pieces of ~8 KiB); raise "
            "--val-fraction, or pass --val-fraction 0 and set --eval.every 0 when training"
        )
    writer.finish()
    print(
        f"{args.output}: {count(index, 'train'):,} training and {count(index, 'val'):,} validation tokens "
        f"({index['dtype']}) in {len(index['train'])} + {len(index['val'])} shards; "
        f"{text_bytes / 1e6:,.1f} MB of text in {elapsed:.1f} s ({text_bytes / 1e6 / elapsed:,.1f} MB/s)"
    )


def input_files(inputs: list[Path], output: Path) -> list[Path]:
    """Every input as a list of files or datasets folders, in a fixed order (the order of the shards); never
    the files of `output` (index.json is JSON), should it be inside an input folder."""
    files: list[Path] = []
    for path in inputs:
        if not path.exists():
            raise DataError(f"input {path} does not exist; give text, JSONL or Parquet files, or folders of them")
        if path.is_dir() and not is_datasets_folder(path):
            inside = [p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
            found = sorted(p for p in inside if not p.resolve().is_relative_to(output.resolve()))
            if not found:
                raise DataError(f"folder {path} holds no .txt, .md, .jsonl, .json or .parquet files")
            files += found
        elif path.is_dir() or path.suffix in SUFFIXES:
            files.append(path)
        else:
            raise DataError(f"input {path}: unknown kind of file; give .txt, .md, .jsonl, .json or .parquet files")
    return files


def is_datasets_folder(path: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset, or a DatasetDict)."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def describe(path: Path) -> dict:
    """What identifies an input for resuming: a changed file must not continue an older run's shards."""
    stat = path.stat()
    return {"path": str(path.resolve()), "bytes": stat.st_size, "modified": stat.st_mtime_ns}


def pieces(files: list[Path], text_field: str) -> Iterator[tuple[str, bool, int]]:
    """(text, whether it ends a document, input bytes it stands for) for every piece of every input, in order."""
    for path in files:
        if path.is_dir():
            yield from document_pieces(datasets_texts(path, text_field), path)
        elif path.suffix in TEXT_SUFFIXES:
            yield from text_file_pieces(path)
        elif path.suffix in JSON_SUFFIXES:
            yield from document_pieces(json_lines_texts(path, text_field), path)
        else:
            yield from document_pieces(parquet_texts(path, text_field), path)


def text_file_pieces(path: Path) -> Iterator[tuple[str, bool, int]]:
    """A text file is one document, cut at line ends into pieces of about PIECE_BYTES."""
    try:
        with open(path, encoding="utf-8") as text:
            piece, size, size_read = [], 0, False
            for line in text:
                piece.append(line)
                size += len(line)
                if size >= PIECE_BYTES:
                    joined = "".join(piece)
                    yield joined, False, len(joined.encode())
                    piece, size, size_read = [], 0, True
            joined = "".join(piece)
            if joined or size_read:  # an empty file is no document
                yield joined, True, len(joined.encode())
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8") from None


def document_pieces(texts: Iterator[tuple[str, int]], path: Path) -> Iterator[tuple[str, bool, int]]:
    """Documents (with the input bytes each stands for) cut into pieces like text files."""
    for text, size in texts:
        if not text:
            continue  # an empty document adds nothing, not even an end-of-text token
        if len(text) <= PIECE_BYTES:
            yield text, True, size
            continue
        lines = text.splitlines(keepends=True)
        piece, piece_size = [], 0
        for line in lines:
            piece.append(line)
            piece_size += len(line)
            if piece_size >= PIECE_BYTES:
                yield "".join(piece), False, 0
                piece, piece_size = [], 0
        yield "".join(piece), True, size


def json_lines_texts(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{path}:{number} is not a JSON object; give one JSON object per line") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f'{path}:{number} has no text field "{text_field}" (a string); name the field with --text-field'
                )
            yield text, len(line.encode())


def parquet_texts(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow; pip install -e '.[data]'") from None
    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        columns = ", ".join(parquet.schema_arrow.names)
        raise DataError(f'{path} has no column "{text_field}" (it has {columns}); name it with --text-field')
    rows = parquet.metadata.num_rows or 1
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or "", path.stat().st_size // rows


def datasets_texts(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise DataError(f"{path}: reading a datasets folder needs datasets; pip install -e '.[data]'") from None
    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise DataError(f"{path} has no train split (it has {', '.join(dataset)}); save the split to prepare")
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        columns = ", ".join(dataset.column_names)
        raise DataError(f'{path} has no column "{text_field}" (it has {columns}); name it with --text-field')
    for batch in dataset.iter(batch_size=1024):
        for text in batch[text_field]:
            yield text or "", 0


def check_output(output: Path) -> None:
    """`output` is new, empty, or holds an earlier run's shards (start_index then checks they are of these inputs)."""
    if output.exists() and not (output / INDEX_FILE).is_file():
        if not output.is_dir() or any(output.iterdir()):
            raise DataError(f"{output} exists and is not an empty folder; give a new --output folder")


def start_index(output: Path, settings: dict, tokenizer: Tokenizer) -> dict:
    """output's index: a new one, or that of an interrupted (or finished) run with the same settings."""
    index_file = output / INDEX_FILE
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        if index.get("format") != FORMAT or index.get("settings") != settings:
            raise DataError(
                f"{output} holds shards prepared from other inputs or settings (see {index_file}); give a new "
                "--output folder"
            )
        return index
    output.mkdir(parents=True, exist_ok=True)  # check_output() refused an existing folder that is not empty
    return {
        "format": FORMAT,
        "settings": settings,
        "tokenizer": settings["tokenizer"],
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
        "train": [],
        "val": [],
        # Every shard has a .docs file: where its documents start (data.document_mask keeps them apart).
        "documents": True,
        "pieces_done": 0,
        "complete": False,
    }


def count(index: dict, split: str) -> int:
    return sum(shard["tokens"] for shard in index[split])


class ShardWriter:
    """Appends token ids to the current train and val shards and publishes each finished one in index.json.

    A shard is written as NAME.tmp and renamed when finished; index.json records it, and how many pieces the
    finished shards hold, at the same moment. A run stopped at any point therefore leaves only finished shards
    in the index, and the next run rewrites whatever came after them. With index["masks"] (chat data) each
    shard has a .mask file beside it: one byte per token, 1 where the token is a target of the loss. Every shard
    has a .docs file: the int64 offsets (within the shard, ascending) of the tokens that begin a document, where
    a piece begins one when the previous piece of its split ended one (data.py's loader reads them to keep
    packed documents from attending to each other).
    """

    def __init__(self, output: Path, index: dict) -> None:
        self.output, self.index = output, index
        self.dtype = np.dtype(index["dtype"])
        self.limit = index["settings"]["shard_tokens"]
        self.open: dict[str, OpenShard] = {}
        # Whether the last piece written to each split ended a document (a split's first piece starts one).
        self.ended = {split: not shards or shards[-1].get("ends_document", True)
                      for split, shards in (("train", index["train"]), ("val", index["val"]))}  # fmt: skip
        for leftover in [*output.glob("*.bin.tmp"), *output.glob("*.mask.tmp"), *output.glob("*.docs.tmp")]:
            leftover.unlink()  # an unfinished shard of the interrupted run: its pieces are tokenized again

    def write(self, batch: list[tuple[int, str, bool, bool]], tokenizer: Tokenizer) -> None:
        """Tokenize the pieces of `batch` together and append them in order."""
        eos = [tokenizer.eos_id]
        encoded = tokenizer.encode_batch([text for _, text, _, _ in batch])
        for (number, _, ends_document, validation), ids in zip(batch, encoded, strict=True):
            self.append("val" if validation else "train", ids + eos if ends_document else ids, None, ends_document)
            self.close_if_full(pieces_done=number + 1)

    def append(self, split: str, ids: list[int], mask: list[int] | None = None, ends_document: bool = True) -> None:
        """Append one piece of text (`ends_document`: its document ends with it; a conversation is one piece)."""
        if not ids:
            return
        if split not in self.open:
            stem = self.output / f"{split}-{len(self.index[split]):05d}"
            self.open[split] = OpenShard(stem, masked=bool(self.index.get("masks")))
        self.open[split].append(np.asarray(ids, dtype=np.int64).astype(self.dtype), mask, self.ended[split])
        self.open[split].ends_document = self.ended[split] = ends_document

    def close_if_full(self, pieces_done: int) -> None:
        if "train" in self.open and self.open["train"].tokens >= self.limit:
            # Both splits end their shards after the same piece, so that index.json's pieces_done is a point to
            # resume from; shards therefore end where they would without an interruption.
            self.close_all(pieces_done)

    def close_all(self, pieces_done: int) -> None:
        for split, shard in sorted(self.open.items()):
            self.index[split].append(shard.close(pieces_done))
        self.open = {}
        self.index["pieces_done"] = pieces_done
        self.save_index()

    def finish(self) -> None:
        self.index["complete"] = True
        self.save_index()

    def save_index(self) -> None:
        staging = self.output / (INDEX_FILE + ".partial")
        staging.write_text(json.dumps(self.index, indent=1) + "\n")
        staging.replace(self.output / INDEX_FILE)


class OpenShard:
    """A shard being written: NAME.bin.tmp, NAME.docs.tmp (and NAME.mask.tmp), renamed to NAME.bin, NAME.docs
    (NAME.mask) by close()."""

    def __init__(self, stem: Path, masked: bool) -> None:
        self.stem, self.tokens, self.largest, self.ends_document = stem, 0, 0, True
        self.file = open(stem.with_name(stem.name + ".bin.tmp"), "wb")
        self.docs_file = open(stem.with_name(stem.name + ".docs.tmp"), "wb")
        self.mask_file = open(stem.with_name(stem.name + ".mask.tmp"), "wb") if masked else None

    def append(self, ids: np.ndarray, mask: list[int] | None, starts_document: bool) -> None:
        self.file.write(ids.tobytes())
        if starts_document:
            self.docs_file.write(np.int64(self.tokens).tobytes())
        if self.mask_file is not None:
            self.mask_file.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.tokens += len(ids)
        self.largest = max(self.largest, int(ids.max()))

    def close(self, pieces_done: int) -> dict:
        shard = {"file": self.stem.name + ".bin", "tokens": self.tokens, "max_id": self.largest,
                 "docs_file": self.stem.name + ".docs", "ends_document": self.ends_document}  # fmt: skip
        for file, suffix in ((self.file, ".bin"), (self.docs_file, ".docs"), (self.mask_file, ".mask")):
            if file is not None:
                file.close()
                Path(file.name).rename(self.stem.with_name(self.stem.name + suffix))
        if self.mask_file is not None:
            shard["mask_file"] = self.stem.name + ".mask"
        return {**shard, "pieces_end": pieces_done}


if __name__ == "__main__":
    main()
