"""Tokenize chat data for supervised fine-tuning: token shards plus a loss mask, with a validation split.

    python scripts/prepare_chat.py chats.jsonl --output data/chats      # then: --data.path data/chats

Each line of a JSONL file is a conversation, {"messages": [{"role": "user", "content": "..."},
{"role": "assistant", "content": "..."}, ...]} (system turns allowed), or a pair {"prompt": "...",
"response": "..."} (a user turn and an assistant turn). The tokenizer's chat template renders it (data.tokenizer,
"" = the model's own). Only the tokens of the assistant's turns (their content and the template's end-of-turn
tokens) are targets of the loss; everything else is context.

Conversations are packed one after another into windows of training.seq_len + 1 tokens, with no padding. A
conversation starts with the template's own tokens, which are never targets, so nothing is predicted across two
conversations. Each conversation is a document (its shard's .docs file records where it starts): with
data.document_mask (the default) a token attends only to its own conversation, with positions restarting at 0.
An interrupted run resumes from its last finished shard; every round(1 / val_fraction)-th conversation goes to
the validation split.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))
# prepare_data.py (beside this script) writes the shards of both scripts.
from prepare_data import DataError, ShardWriter, check_output, count, describe, run, start_index  # noqa: E402

from config import load_config  # noqa: E402
from tokenizer import Tokenizer, load_tokenizer  # noqa: E402

ROLES = ("system", "user", "assistant", "tool")


def main() -> None:
    parser = argparse.ArgumentParser(description="Tokenize chat JSONL into token shards with a loss mask.")
    parser.add_argument("inputs", nargs="+", type=Path, help="JSONL files of conversations")
    parser.add_argument("--output", type=Path, required=True, help="a new (or empty) folder for the shards")
    parser.add_argument("--tokenizer", default=None, help="default: data.tokenizer, else model.path")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="of the conversations (default: %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default: 1e8)")
    parser.add_argument("--config", type=Path, default=SCRIPTS.parent / "config.toml", help="default: %(default)s")
    run(prepare, parser)  # as prepare_data.py: checks --val-fraction and --shard-tokens, one line per mistake


def prepare(args: argparse.Namespace) -> None:
    config = load_config(args.config)
    spec = args.tokenizer or config.data.tokenizer or config.model.path
    tokenizer = load_tokenizer(spec)
    if not tokenizer.backend.chat_template:
        raise DataError(
            f"the tokenizer of {spec} has no chat template (tokenizer_config.json's chat_template); use an "
            "instruct model's tokenizer with --tokenizer, or add a template"
        )
    check_output(args.output)
    for path in args.inputs:
        if not path.is_file():
            raise DataError(f"input {path} is not a file; give JSONL files of conversations")
    settings = {
        "inputs": [describe(path) for path in args.inputs],
        "tokenizer": str(spec),
        "val_fraction": args.val_fraction,
        "shard_tokens": args.shard_tokens,
        "chat": True,
    }
    created = not args.output.exists()
    index = start_index(args.output, settings, tokenizer)
    index["masks"] = True
    try:
        write_shards(args, tokenizer, index)
    except DataError:
        if created:
            shutil.rmtree(args.output)  # only this run's own files are in a folder it created
        raise


def write_shards(args: argparse.Namespace, tokenizer: Tokenizer, index: dict) -> None:
    if index["complete"]:
        print(f"{args.output} is already prepared ({count(index, 'train'):,} training tokens); nothing to do")
        return
    writer = ShardWriter(args.output, index)
    every = round(1 / args.val_fraction) if args.val_fraction else 0
    targets, total = 0, 0
    for number, (where, messages) in enumerate(tqdm(conversations(args.inputs), desc="conversations", unit="")):
        total = number + 1
        if number < index["pieces_done"]:
            continue  # in a shard the interrupted run finished
        ids, mask = encode(tokenizer, messages, where)
        targets += sum(mask)
        writer.append("val" if every and (number + 1) % every == 0 else "train", ids, mask)
        writer.close_if_full(pieces_done=number + 1)
    writer.close_all(total)
    if count(index, "train") == 0:
        raise DataError(f"the inputs hold no conversation ({', '.join(map(str, args.inputs))})")
    if every and count(index, "val") == 0:
        raise DataError(
            f"no conversation went to the validation split (fewer than {every}); raise --val-fraction, or pass "
            "--val-fraction 0 and set --eval.every 0 when training"
        )
    writer.finish()
    print(
        f"{args.output}: {total:,} conversations, {count(index, 'train'):,} training and {count(index, 'val'):,} "
        f"validation tokens, {targets:,} of them targets (the assistant's)"
    )


def conversations(inputs: list[Path]) -> Iterator[tuple[str, list[dict]]]:
    """(file:line, messages) of every conversation, in order."""
    for path in inputs:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield f"{path}:{number}", messages_of(line, f"{path}:{number}")


def messages_of(line: str, where: str) -> list[dict]:
    """A JSON line as chat messages: its "messages", or its "prompt" and "response" as a user and an assistant turn."""
    fix = 'give {"messages": [{"role": "user", "content": "..."}, ...]} or {"prompt": "...", "response": "..."}'
    try:
        record = json.loads(line)
    except ValueError:
        raise DataError(f"{where} is not a JSON object; {fix}") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where} has neither a messages list nor prompt and response strings; {fix}")
    for message in messages:
        valid = isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)
        if not valid:
            raise DataError(f"{where}: a message needs a role ({', '.join(ROLES)}) and a string content; {fix}")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where} has no assistant turn, so nothing to train on; {fix}")
    return messages


def encode(tokenizer: Tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """The conversation's token ids and mask (1 for the tokens of assistant turns).

    An assistant turn's tokens are those the template adds after the conversation up to it with the generation
    prompt (`<|assistant|>`-like header) and through it: its content and its end-of-turn tokens.
    """
    ids = render(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:turn], add_generation_prompt=True)
        through = render(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise DataError(
                f"{where}: the chat template does not render this conversation as a sequence of growing prefixes, "
                "so the assistant's tokens cannot be told apart; use a standard template"
            )
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    if mask[0]:
        raise DataError(f"{where}: the conversation starts with an assistant token; start it with a user turn")
    return ids, mask


def render(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    text = tokenizer.backend.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text)


if __name__ == "__main__":
    main()
