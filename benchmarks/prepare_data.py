"""Throughput of a generated project's scripts/prepare_data.py against the tokenizer alone on the same text.

    python benchmarks/prepare_data.py [--megabytes 200] [--tiny]

The corpus is real text found on this machine: the Python source files of the installed packages,
concatenated into text files of ~10 MB. A byte-level BPE tokenizer (32k tokens, `tokenizers`) is trained on
its first 20 MB. Prints the MB/s of prepare_data.py (reading, piece splitting, tokenizing on all cores,
writing shards and the validation split) and of `Tokenizer.encode_batch` over the same text held in memory
(the reference: tokenizing alone), and their ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_corpus(folder: Path, megabytes: float) -> int:
    """Source files of site-packages into ~10 MB text files under `folder`; returns the bytes written."""
    folder.mkdir()
    target, written, part, out = int(megabytes * 1e6), 0, 0, None
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        if written >= target:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if out is None or out.tell() > 10_000_000:
            if out is not None:
                out.close()
            out = open(folder / f"part-{part:03d}.txt", "w", encoding="utf-8")
            part += 1
        out.write(text + "\n\n")
        written += len(text.encode()) + 2
    if out is not None:
        out.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=200.0, help="corpus size (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="2 MB, for the test suite")
    args = parser.parse_args()
    megabytes = 2.0 if args.tiny else args.megabytes
    from tokenizers import ByteLevelBPETokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = write_corpus(root / "corpus", megabytes)
        files = sorted((root / "corpus").iterdir())
        bpe = ByteLevelBPETokenizer()
        head = files[0].read_text(encoding="utf-8")[:20_000_000]
        bpe.train_from_iterator([head], vocab_size=2_000 if args.tiny else 32_000, special_tokens=["<|endoftext|>"])
        bpe.save(str(root / "tokenizer.json"))
        project = root / "project"
        subprocess.run([sys.executable, "-m", "fsdp2gen", "new", str(project), "-y", "--gpus", "8", "--fp32",
                        "--tokenizer", str(root / "tokenizer.json")], check=True, capture_output=True)  # fmt: skip

        started = time.perf_counter()
        subprocess.run([sys.executable, "scripts/prepare_data.py", str(root / "corpus"), "--output",
                        str(root / "data")], cwd=project, check=True, capture_output=True)  # fmt: skip
        script_s = time.perf_counter() - started

        # The reference: encode_batch on the same text, read into memory first, in batches of the same size.
        texts = [path.read_text(encoding="utf-8") for path in files]
        pieces = [text[i : i + 8192] for text in texts for i in range(0, len(text), 8192)]
        started = time.perf_counter()
        for i in range(0, len(pieces), 1024):
            bpe.encode_batch(pieces[i : i + 1024])
        encode_s = time.perf_counter() - started
    cores = os.cpu_count()
    print(f"corpus: {size / 1e6:,.1f} MB of Python source text, {len(files)} files; {cores} CPU cores")
    print(f"prepare_data.py: {script_s:.1f} s, {size / 1e6 / script_s:,.1f} MB/s (process start and imports included)")
    print(f"encode_batch alone: {encode_s:.1f} s, {size / 1e6 / encode_s:,.1f} MB/s")
    print(f"ratio prepare_data / encode_batch time: {script_s / encode_s:.2f}")


if __name__ == "__main__":
    main()
