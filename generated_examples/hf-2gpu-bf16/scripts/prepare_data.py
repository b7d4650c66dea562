"""Tokenize a text file with the model's tokenizer into the token file that train.py reads (data.path).

    python scripts/prepare_data.py corpus.txt                          # -> data/tokens.bin
    python scripts/prepare_data.py corpus.txt --output data/train.bin --config config.toml
    scripts/launch_local.sh --data.path data/tokens.bin

The tokenizer is the one in the folder of config.toml's model.path. The text is read and tokenized a block
of lines at a time, so the file may be larger than memory; the token ids are written as one flat array of
uint16 (uint32 when the vocabulary has more than 65536 entries), followed by the end-of-text token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from config import load_config  # noqa: E402
from data import token_dtype  # noqa: E402

LINES_PER_BLOCK = 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description="Tokenize a text file into a token file for data.path.")
    parser.add_argument("text", type=Path, help="a UTF-8 text file")
    parser.add_argument("--output", type=Path, default=Path("data/tokens.bin"), help="default: %(default)s")
    parser.add_argument("--config", type=Path, default=PROJECT / "config.toml", help="default: %(default)s")
    args = parser.parse_args()
    model = load_config(args.config).model
    tokenizer = AutoTokenizer.from_pretrained(model.folder)
    dtype = token_dtype(model.vocab_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = args.output.with_name(args.output.name + ".tmp")
    count = 0
    with open(args.text, encoding="utf-8") as text, open(partial, "wb") as out:
        while block := "".join(line for _, line in zip(range(LINES_PER_BLOCK), text, strict=False)):
            ids = np.array(tokenizer(block, add_special_tokens=False)["input_ids"], dtype=np.int64)
            if len(ids) and ids.max() >= model.vocab_size:
                sys.exit(f"token id {ids.max()} >= model vocab_size {model.vocab_size}: tokenizer and model differ")
            out.write(ids.astype(dtype).tobytes())
            count += len(ids)
        if tokenizer.eos_token_id is not None:
            out.write(np.array([tokenizer.eos_token_id], dtype=dtype).tobytes())
            count += 1
    partial.replace(args.output)
    print(f"{args.text} -> {args.output}: {count:,} tokens ({np.dtype(dtype).name})")


if __name__ == "__main__":
    main()
