"""Chat data for the fine-tuning runs (`--task sft`) of the parallel hf tests: a tiny model with a byte-level BPE
tokenizer that has a chat template (tests/conftest.py's save_tiny_llama), and conversations of uneven lengths whose
prompts are context and whose responses are targets, prepared by the project's own scripts/prepare_chat.py (run in
the launch that trains on them: tests/helpers/several_runs.py's "scripts")."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.conftest import save_tiny_llama

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
WORDS = "alpha beta gamma delta red green blue one two three four five six seven".split()


def chat_model(folder: Path, config=None) -> Path:
    """A pretrained-model folder with a chat tokenizer (300 tokens): a tiny Llama (vocabulary 320), or the model of
    the transformers `config` (its vocab_size at least 300), saved over it."""
    save_tiny_llama(folder, " ".join(WORDS) * 20, special_tokens=SPECIAL, chat_template=TEMPLATE)
    if config is not None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def prepare_chats(project: Path, folder: Path, count: int = 60) -> list[str]:
    """`count` conversations written to folder/chats.jsonl; returns the argv (for several_runs.py's "scripts") of
    `project`'s scripts/prepare_chat.py that prepares them into folder/chats."""
    rng = random.Random(0)
    lines = [
        json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 12))),
                    "response": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))}) + "\n"
        for _ in range(count)
    ]  # fmt: skip
    (folder / "chats.jsonl").write_text("".join(lines))
    return [
        str(project / "scripts" / "prepare_chat.py"),
        str(folder / "chats.jsonl"),
        "--output",
        str(folder / "chats"),
    ]
