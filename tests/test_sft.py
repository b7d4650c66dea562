"""Supervised fine-tuning (`--task sft`, family hf) on chat data: a tiny Llama made here with transformers and a
tokenizer with a chat template, conversations prepared with scripts/prepare_chat.py, trained with tensor
parallelism on 2 gloo ranks (tp 2: the model's declared tp plan, the masked loss of the vocabulary-split output
layer under loss_parallel), equal to one process. No network. (SFT over data-parallel ranks: test_qlora.py's run,
and test_document_masking.py.)
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import generate, metrics, project_modules, save_tiny_llama, torchrun
from tests.helpers.scripts import run_scripts

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "alpha beta gamma delta red green blue one two three four five six seven".split()
TRAIN = ["--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "0",
         "--training.lr", "1e-3", "--job.device", "cpu", "--job.log_every", "1", "--eval.every", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama with a byte-level BPE tokenizer that has a chat template, a generated sft project, and 300
    conversations of uneven lengths prepared into shards."""
    root = tmp_path_factory.mktemp("sft")
    rng = random.Random(0)
    records = []
    for number in range(300):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        response = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
        if number % 2:
            records.append({"prompt": prompt, "response": response})
        else:
            records.append({"messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": prompt},
                                         {"role": "assistant", "content": response}]})  # fmt: skip
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    special = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    model_dir = save_tiny_llama(root / "model", " ".join(WORDS) * 20, special_tokens=special, chat_template=TEMPLATE)
    project = generate(root / "run", "--family", "hf", "--hf-model", str(model_dir), "--task", "sft", "--gpus", "2",
                       "--tp", "2", "--fp32")  # fmt: skip
    scripts = {"prepare": ["scripts/prepare_chat.py", str(root / "chats.jsonl"), "--output", str(root / "data"),
                           "--val-fraction", "0.1"]}  # fmt: skip
    # The scripts of the other tests, in the same Python process (run_scripts: an hf project's imports cost ~6 CPU-s
    # a process): test_bad_chat_lines_are_one_line_and_exit_2's cases ("bad/CASE": prepare_chat.py of the case's
    # file), test_a_tokenizer_without_chat_template_is_refused's ("no-template": prepare_chat.py with the model's
    # tokenizer saved without its template), test_the_data_line_says_plain_text_and_names_prepare_chat's ("plain":
    # prepare_data.py of plain text; "lines": the data lines, last, as it joins a process group).
    for case, (line, _) in BAD_CHATS.items():
        (root / "bad" / case).mkdir(parents=True)
        (root / "bad" / case / "chats.jsonl").write_text(line)
        scripts[f"bad/{case}"] = ["scripts/prepare_chat.py", str(root / "bad" / case / "chats.jsonl"), "--output",
                                  str(root / "bad" / case / "data")]  # fmt: skip
    from transformers import AutoTokenizer

    plain = root / "no-template" / "plain"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    scripts["no-template"] = ["scripts/prepare_chat.py", str(root / "chats.jsonl"), "--output",
                              str(root / "no-template" / "data"), "--tokenizer", str(plain)]  # fmt: skip
    (root / "text.txt").write_text(" ".join(WORDS) * 50)
    (root / "data_lines.py").write_text(DATA_LINES)
    scripts["plain"] = ["scripts/prepare_data.py", str(root / "text.txt"), "--output", str(root / "plain"),
                        "--val-fraction", "0"]  # fmt: skip
    scripts["lines"] = [str(root / "data_lines.py"), str(root / "plain"), str(root / "data"), ""]
    results = dict(zip(scripts, run_scripts(project, *scripts.values()), strict=True))
    assert results["prepare"][0] == 0, results["prepare"][2]
    return {"root": root, "project": project, "model": model_dir, "data": root / "data", "records": records,
            "scripts": results}  # fmt: skip


def shards(data: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    index = json.loads((data / "index.json").read_text())
    tokens = np.concatenate([np.fromfile(data / s["file"], dtype=np.uint16) for s in index[split]])
    mask = np.concatenate([np.fromfile(data / s["mask_file"], dtype=np.uint8) for s in index[split]])
    return tokens.astype(np.int64), mask


def test_only_the_assistants_tokens_are_targets(chat: dict) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat["model"])
    tokens, mask = shards(chat["data"], "train")
    assert len(tokens) == len(mask)
    # The masked runs, decoded, are each response followed by the template's end-of-turn token, in order.
    runs = np.split(np.arange(len(mask)), np.flatnonzero(np.diff(mask)) + 1)
    targets = [tokenizer.decode(tokens[run]) for run in runs if mask[run[0]]]
    responses = [r.get("response") or r["messages"][-1]["content"] for n, r in enumerate(chat["records"])
                 if (n + 1) % 10]  # every 10th conversation is in the validation split  # fmt: skip
    assert targets == [response + "<|end|>" for response in responses]


@pytest.fixture(scope="module")
def trained(chat: dict) -> list[dict]:
    """One tp 2 run (2 ranks) for both training tests: 12 steps of 2 micro-batches, validated at steps 6 and 12; its
    metrics. Plain causal attention over the packed windows, as test_masked_loss's reference computes it
    (document masking: tests/test_document_masking.py, and test_qlora.py's sft run)."""
    out = chat["root"] / "trained"
    torchrun(chat["project"], "train.py", *TRAIN, "--data.path", str(chat["data"]), "--training.steps", "12",
             "--training.grad_accum_steps", "2", "--data.document_mask", "false", "--eval.every", "6",
             "--eval.batches", "1", "--training.lr", "3e-3", "--job.output_dir", str(out))  # fmt: skip
    return metrics(out)


def test_masked_loss_with_tp2_and_accumulation_equals_plain_pytorch(chat: dict, trained: list[dict]) -> None:
    # Step 1's loss and gradient norm (before any update: the learning rate plays no part) against a one-process
    # computation over the same 8 samples: the mean cross-entropy over all assistant tokens of the step, not a mean
    # of per-micro-batch means (the samples hold different numbers of targets, so those would differ). Both tp ranks
    # compute it from their halves of the vocabulary (loss_parallel), the prompts' targets ignored in each.
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    record = trained[0]
    assert record["step"] == 1

    seq_len, batch, seed = 32, 8, 0
    tokens, mask = shards(chat["data"], "train")
    windows = (len(tokens) - 1) // seq_len  # one shard: windows of seq_len + 1 tokens, every seq_len
    order = np.random.default_rng([seed, 0]).permutation(windows)[:batch]  # data.py's epoch-0 order
    rows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in order])
    row_masks = np.stack([mask[i * seq_len : i * seq_len + seq_len + 1] for i in order])
    per_micro_batch = row_masks[:, 1:].reshape(2, -1).sum(axis=1)
    assert per_micro_batch[0] != per_micro_batch[1], per_micro_batch  # unequal targets in the two micro-batches
    targets = np.where(row_masks[:, 1:] == 1, rows[:, 1:], -100)
    model = AutoModelForCausalLM.from_pretrained(chat["model"], dtype=torch.float32)
    logits = model(torch.from_numpy(rows[:, :-1])).logits
    loss = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(targets).flatten(), ignore_index=-100)
    loss.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert abs(record["loss"] - loss.item()) <= 1e-5, (record["loss"], loss.item())
    assert abs(record["grad_norm"] - grad_norm.item()) <= 1e-5 * max(1.0, grad_norm.item())


def test_prompt_tokens_get_no_gradient(chat: dict) -> None:
    # The generated loss, on logits that require grad: the gradient at every prompt position is exactly zero,
    # so no label of a prompt token can change the update; at every assistant position it is not.
    # In this process, with the project's IGNORE (project_modules: its data.py imported here, forgotten after).
    import torch
    import torch.nn.functional as F

    with project_modules(chat["project"]):
        from data import IGNORE
    logits = torch.randn(2, 6, 10, requires_grad=True, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE, 1], [IGNORE, 2, 2, IGNORE, IGNORE, IGNORE]])
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum").backward()
    assert (logits.grad.abs().sum(-1) > 0).int().tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    # ...and train.py's train_step computes the loss exactly that way (model.py's loss, summed).
    source = (chat["project"] / "train.py").read_text()
    assert 'model_loss(model, *batch, reduction="sum", chunks=chunks)' in source
    loss = (chat["project"] / "chunked_loss.py").read_text()
    assert "F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction=reduction)" in loss
    # Chunked (training.loss_chunks), each chunk's loss is that sum over its own targets.
    assert 'checkpoint(cross_entropy, output_layer, h, t, "sum", use_reentrant=False)' in loss


def test_sft_trains_and_the_validation_loss_falls(trained: list[dict]) -> None:
    validation = [r["val_loss"] for r in trained if "val_loss" in r]
    assert len(validation) == 2 and validation[1] < validation[0], validation


BAD_CHATS = {
    "no-fields": ('{"text": "hello"}\n', "{path}:1 has neither a messages list nor prompt and response strings"),
    "no-assistant": ('{"messages": [{"role": "user", "content": "hi"}]}\n', "{path}:1 has no assistant turn"),
    "bad-role": ('{"messages": [{"role": "robot", "content": "hi"}]}\n', "{path}:1: a message needs a role"),
    "not-json": ("hello\n", "{path}:1 is not a JSON object"),
}


@pytest.fixture(scope="module")
def bad_chats(chat: dict) -> dict[str, tuple[Path, tuple]]:
    """Each case's folder (its chats.jsonl) and scripts/prepare_chat.py's (exit code, stdout, stderr) on it (run in
    the chat fixture's Python process)."""
    return {case: (chat["root"] / "bad" / case, chat["scripts"][f"bad/{case}"]) for case in BAD_CHATS}


@pytest.mark.parametrize("case", BAD_CHATS)
def test_bad_chat_lines_are_one_line_and_exit_2(case: str, bad_chats: dict) -> None:
    _, expected = BAD_CHATS[case]
    folder, (code, _, stderr) = bad_chats[case]
    path = folder / "chats.jsonl"
    assert code == 2, stderr
    [message] = [line for line in stderr.splitlines() if line.startswith("prepare_chat.py: error: ")]
    assert message.startswith("prepare_chat.py: error: " + expected.format(path=path)), message
    assert not (folder / "data").exists()


def test_a_tokenizer_without_chat_template_is_refused(chat: dict) -> None:
    # prepare_chat.py with the model's tokenizer saved without its chat template (run in the chat fixture's process).
    plain = chat["root"] / "no-template" / "plain"
    code, _, stderr = chat["scripts"]["no-template"]
    assert code == 2
    assert stderr.splitlines()[-1] == (
        f"prepare_chat.py: error: the tokenizer of {plain} has no chat template (tokenizer_config.json's "
        "chat_template); use an instruct model's tokenizer with --tokenizer, or add a template"
    )


def test_sft_needs_the_hf_family(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "fsdp2gen", "new", str(tmp_path / "run"), "--yes", "--task", "sft"],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert "--task sft renders conversations with a tokenizer's chat template, which the hf family has" in result.stderr


# Rank 0's data line, as train.py prints it, for each data.path: one process in a 1-rank gloo group (what torchrun
# would start), so that open_datasets runs as in train().
DATA_LINES = """
import sys
import torch.distributed as dist
from config import parse_args
from train import open_datasets
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
for path in sys.argv[1:]:
    open_datasets(parse_args(["--data.path", path, "--training.seq_len", "32", "--eval.every", "0"]))
"""


def test_the_data_line_says_plain_text_and_names_prepare_chat(chat: dict) -> None:
    """Plain-text shards (scripts/prepare_data.py) train every token: allowed in an sft project, never silently. And
    the hint of a run on synthetic tokens names the chat preparation, not scripts/prepare_data.py."""
    # The preparation, then the data lines (DATA_LINES), in the chat fixture's Python process (run_scripts).
    prepared, result = chat["scripts"]["plain"], chat["scripts"]["lines"]
    assert prepared[0] == 0, prepared[2]
    assert result[0] == 0, result[2]
    lines = result[1].splitlines()
    assert lines[0].startswith(
        f"data: {chat['root'] / 'plain'} is PLAIN TEXT (no loss mask: scripts/prepare_data.py or a token file), so "
        "every token is a target, as in pretraining; chats to fine-tune on are prepared by scripts/prepare_chat.py: "
    ), lines
    assert lines[1].startswith(f"data: {chat['data']}: "), lines
    assert lines[3] == "data: to train on chats, prepare them with scripts/prepare_chat.py and pass --data.path", lines
