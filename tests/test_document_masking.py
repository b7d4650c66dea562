"""Document masking for packed data (issue 27, data.document_mask), llama and custom projects, fp32, on CPU.

scripts/prepare_data.py records where each document starts (.docs beside every shard); data.py hands each token
its position (restarting at every document start) and document id; the model attends within documents only.
Proven here: a packed batch's loss is the token-weighted mean of its documents' losses run one by one; a token's
logits do not change when the document before it is replaced (and do with --data.document_mask false); 2 gloo
ranks train on packed data; data without document starts is refused in one line; the loader's positions and ids
match a plain loop for any drawn document lengths.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import jinja2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import TINY, generate, metrics
from tests.helpers.in_process import preflight_cases_in_this_process
from tests.helpers.scripts import captured_in_this_process, run_in_this_process
from tests.helpers.several_runs import launch_several

HELPERS = Path(__file__).parent / "helpers"
WORDS = "the a cat dog runs sleeps on under red blue small big house tree river stone bird sings".split()
VOCAB = 300


def tiny(family: str) -> list[str]:
    """TINY with the corpus tokenizer's vocabulary (custom models have no n_kv_heads or ffn_dim)."""
    pairs = dict(zip(TINY[::2], TINY[1::2], strict=True)) | {"--model.vocab_size": str(VOCAB), "--job.device": "cpu"}
    if family == "custom":
        del pairs["--model.n_kv_heads"], pairs["--model.ffn_dim"]
    return [item for pair in pairs.items() for item in pair]


def documents(count: int, seed: int) -> list[str]:
    """Short documents of 2 to 12 words: a window of 32 tokens holds several."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) + "." for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A JSON-lines file of 600 short documents, a text file (one long document), and a BPE tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("documents")
    with open(root / "docs.jsonl", "w") as lines:
        for text in documents(600, 0):
            lines.write(json.dumps({"text": text}) + "\n")
    (root / "long.txt").write_text("\n".join(documents(800, 1)) + "\n")  # ~9 pieces of 8 KiB, one document
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(root / "long.txt")], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return {"root": root, "tokenizer": root / "tokenizer.json"}


def prepare(project: Path, output: Path, *inputs: Path, shard_tokens: int = 100_000, val: str = "0") -> Path:
    """`python scripts/prepare_data.py INPUTS ...` of `project`, run in this process (captured_in_this_process: one
    process, nothing distributed; a process of its own would import torch again)."""
    options = ["--output", str(output), "--val-fraction", val, "--shard-tokens", str(shard_tokens)]
    code, _, stderr = captured_in_this_process(project, "scripts/prepare_data.py", *map(str, inputs), *options)
    assert code == 0, stderr
    return output


@pytest.fixture(scope="module")
def families(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """A llama and a custom project with the corpus tokenizer, each with the JSON-lines documents prepared (every
    10th document in the validation split)."""
    root = tmp_path_factory.mktemp("families")
    made = {}
    for family in ("llama", "custom"):
        project = generate(root / family, "--family", family, "--gpus", "2", "--fp32", "--tokenizer",
                           str(corpus["tokenizer"]))  # fmt: skip
        data = prepare(project, root / f"{family}-data", corpus["root"] / "docs.jsonl", val="0.1")
        made[family] = {"project": project, "data": data}
    return made


def probe(family: str, project: Path, data: Path) -> dict:
    """tests/helpers/document_probe.py's report: one process, nothing distributed, so run in this one
    (run_in_this_process), its printed JSON captured."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_in_this_process(project, str(HELPERS / "document_probe.py"), str(data), *tiny(family))
    return json.loads(printed.getvalue())


@pytest.fixture(scope="module")
def probed(families: dict) -> Callable[[str], dict]:
    """family -> tests/helpers/document_probe.py's report, one process per family (made by the first test that asks),
    read by the two tests below."""
    made: dict[str, dict] = {}

    def report(family: str) -> dict:
        if family not in made:
            made[family] = probe(family, families[family]["project"], families[family]["data"])
        return made[family]

    return report


@pytest.mark.parametrize("family", ["llama", "custom"])
def test_a_packed_batch_scores_as_its_documents_alone(family: str, probed: Callable[[str], dict]) -> None:
    found = probed(family)
    assert found["documents"] > 2 * 8  # several documents per window of the batch of 8
    # The cross-document targets (a document's last token -> the next one's first) are left out: each window
    # holds one fewer target than documents that start inside it.
    assert found["ignored"] > 8
    assert found["packed"] == pytest.approx(found["alone"], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("family", ["llama", "custom"])
def test_a_token_never_sees_the_document_before_it(family: str, probed: Callable[[str], dict]) -> None:
    found = probed(family)
    assert found["last_document"] >= 3 and found["before_length"] > 0
    assert found["kept"] < 1e-6
    # The same change moves the logits when attention spans the window (--data.document_mask false).
    assert found["changed"] > 1e-3


def test_prepare_data_records_every_document_start(corpus: dict[str, Path], families: dict, tmp_path: Path) -> None:
    """.docs lists exactly the tokens after an end-of-text token (and a shard's first token when the shard before
    it ended a document), also for a long text file cut into pieces and shards of 700 tokens."""
    project = families["llama"]["project"]
    data = prepare(project, tmp_path / "data", corpus["root"] / "long.txt", corpus["root"] / "docs.jsonl",
                   shard_tokens=700)  # fmt: skip
    index = json.loads((data / "index.json").read_text())
    assert index["documents"] is True and len(index["train"]) > 3
    eos = index["eos_id"]
    starts_next = True
    for shard in index["train"]:
        tokens = np.fromfile(data / shard["file"], dtype=np.uint16)
        docs = np.fromfile(data / shard["docs_file"], dtype=np.int64)
        expected = [0] if starts_next else []
        expected += [i + 1 for i in np.flatnonzero(tokens == eos) if i + 1 < len(tokens)]
        assert docs.tolist() == expected
        starts_next = bool(tokens[-1] == eos)
        assert shard["ends_document"] == starts_next
    # The long text file is one document: its first shard's offsets start at 0, then none until its end.
    assert np.fromfile(data / index["train"][1]["docs_file"], dtype=np.int64).size == 0


def test_two_ranks_train_on_packed_documents(corpus: dict, families: dict, tmp_path: Path) -> None:
    """2 gloo ranks (FSDP, and tp 2: the mask and per-token rotary tables under tensor parallelism) train on the
    packed documents; the losses are not those of plain causal attention over the same windows."""
    project, data = families["llama"]["project"], families["llama"]["data"]
    common = [*tiny("llama"), "--data.path", str(data), "--eval.every", "2", "--eval.batches", "1",
              "--training.steps", "3"]  # fmt: skip
    # Plain causal attention's first loss (before any update) is all the comparison needs: its 1-step run rides in
    # the masked run's launch (tests/helpers/several_runs.py: train.train() per run, each its own config).
    unmasked = [*common, "--training.steps", "1", "--data.document_mask", "false", "--job.output_dir",
                str(tmp_path / "plain")]  # fmt: skip
    # The tp 2 run too, by the tp project's train.py (several_runs.py's "project").
    tp = generate(tmp_path / "tp", "--gpus", "2", "--tp", "2", "--fp32", "--tokenizer", str(corpus["tokenizer"]))
    tp_masked = {"args": [*common, "--job.output_dir", str(tmp_path / "tp-masked")], "project": str(tp)}
    launch_several(project, [[*common, "--job.output_dir", str(tmp_path / "masked")], unmasked, tp_masked],
                   tmp_path / "runs.json", nproc=2)  # fmt: skip
    masked, plain, tp_masked = (metrics(tmp_path / run) for run in ("masked", "plain", "tp-masked"))
    assert len(masked) == 3 and len(plain) == 1
    assert all(np.isfinite(record["loss"]) for record in masked)
    # The same tokens and weights: only the attention, the positions and the skipped targets differ.
    assert abs(masked[0]["loss"] - plain[0]["loss"]) > 1e-4
    # tp 2 splits the same model's heads: the same losses and validation losses as 2 data-parallel ranks.
    for name in ("loss", "val_loss"):
        ours, theirs = [r[name] for r in masked if name in r], [r[name] for r in tp_masked if name in r]
        assert len(ours) == len(theirs) > 0 and np.allclose(ours, theirs, rtol=0, atol=1e-5), (name, ours, theirs)


def test_data_without_document_starts_is_refused(families: dict, tmp_path: Path) -> None:
    project, data = families["llama"]["project"], families["llama"]["data"]
    flat = tmp_path / "tokens.bin"
    np.fromfile(data / "train-00000.bin", dtype=np.uint16).tofile(flat)
    old = tmp_path / "old"
    old.mkdir()
    index = json.loads((data / "index.json").read_text())
    for shard in index["train"] + index["val"]:
        (old / shard["file"]).write_bytes((data / shard["file"]).read_bytes())
        del shard["docs_file"], shard["ends_document"]
    del index["documents"]
    (old / "index.json").write_text(json.dumps(index))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in data.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    docs = np.fromfile(data / "train-00000.docs", dtype=np.int64)
    docs[::-1].tofile(damaged / "train-00000.docs")  # descending
    tokens = index["train"][0]["tokens"]
    cases = {
        flat: f"data.path {flat} is a flat token file, which does not record where documents start, so "
        "data.document_mask cannot keep them apart; prepare a folder with scripts/prepare_data.py, or pass "
        "--data.document_mask false",
        old: f"data.path {old} was prepared without document starts (an older scripts/prepare_data.py), so "
        f"data.document_mask cannot keep its documents apart; prepare it again with scripts/prepare_data.py "
        f"--output {old}-new and point --data.path there, or pass --data.document_mask false",
        damaged: f"data.path {damaged}: train-00000.docs is not ascending int64 offsets within its shard of {tokens} "
        f"tokens (it is damaged or belongs to another shard); prepare it again with scripts/prepare_data.py --output "
        f"{damaged}-new and point --data.path there",
    }
    # Each case refused, and the fix named works: without document masking the same data passes. The first case by
    # `python preflight.py` itself (its __main__, run in this process: captured_in_this_process), the others by its
    # main() as that runs it (tests/helpers/preflight_driver.py's run_case), all in this process: preflight involves
    # nothing distributed, and a process of its own would import torch again.
    argv = {f"{path.name}-{mask}": ["--world-size", "2", *tiny("llama"), "--eval.every", "0", "--data.path",
                                    str(path), *([] if mask else ["--data.document_mask", "false"])]
            for path in cases for mask in (True, False)}  # fmt: skip
    first = captured_in_this_process(project, "preflight.py", *argv["tokens.bin-True"])
    driven = preflight_cases_in_this_process(
        project, {case: args for case, args in argv.items() if case != "tokens.bin-True"}
    )
    results = driven | {"tokens.bin-True": list(first)}
    for path, line in cases.items():
        assert results[f"{path.name}-True"] == [2, "", f"preflight.py: error: {line}\n"], path
        assert results[f"{path.name}-False"][0] == 0, (path, results[f"{path.name}-False"])


# ---- The loader against a plain loop, for drawn document lengths -------------------------------------------

DATA_PY = Path(__file__).parents[1] / "templates" / "project" / "data.py.jinja"


def load_data_module(task: str = "sft"):
    """The template's data.py as a project of `task` renders it. An sft project's reads chat data's loss masks too;
    a pretrain project's refuses chat data, and reads plain text, documents included, as the sft one does."""
    source = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True).from_string(
        DATA_PY.read_text()
    )
    module = ModuleType(f"project_data_for_document_masking_{task}")
    sys.modules[module.__name__] = module
    exec(compile(source.render(task=task), str(DATA_PY), "exec"), module.__dict__)
    return module


DATA = load_data_module()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=30),
    first_is_start=st.booleans(),
    seq_len=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_positions_and_document_ids_match_a_plain_loop(
    lengths: list[int], first_is_start: bool, seq_len: int, seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One shard of documents of the drawn lengths (the first one, unless drawn, continuing from a shard before):
    every window's positions, document ids and targets are those of a loop over its tokens."""
    total = sum(lengths)
    if total < seq_len + 1:
        return
    folder = tmp_path_factory.mktemp("shard")
    tokens = np.random.default_rng(seed).integers(0, 100, total).astype(np.uint16)
    tokens.tofile(folder / "train-00000.bin")
    starts = list(np.cumsum([0, *lengths[:-1]]))[(0 if first_is_start else 1) :]
    np.array(starts, dtype=np.int64).tofile(folder / "train-00000.docs")
    shard = {"file": "train-00000.bin", "tokens": total, "max_id": int(tokens.max()), "docs_file": "train-00000.docs"}
    (folder / "index.json").write_text(json.dumps({"dtype": "uint16", "train": [shard], "val": []}))
    samples = DATA.TokenShards(folder, "train", seq_len, documents=True)
    [batch] = DATA.micro_batches(samples, 0, len(samples), 1, 0, 1)
    for window in range(len(samples)):
        begin = window * seq_len
        positions, ids, targets = [], [], []
        for i in range(seq_len):
            at = begin + i
            if i == 0 or at in starts:
                position, document = 0, (ids[-1] if ids else 0) + 1
            positions.append(position)
            ids.append(document)
            targets.append(DATA.IGNORE if at + 1 in starts else int(tokens[at + 1]))
            position += 1
        assert batch.inputs[window].tolist() == tokens[begin : begin + seq_len].tolist()
        assert batch.positions[window].tolist() == positions
        assert batch.document_ids[window].tolist() == ids
        assert batch.targets[window].tolist() == targets


# ---- document_attention.py: both masks against attention run document by document ------------------------

ATTENTION_PY = DATA_PY.parent / '{% if family != "hf" %}document_attention.py{% endif %}'


# Eager flex_attention is the point here: the check of the mask_mod, not the speed of a fused kernel.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_both_masks_attend_as_each_document_alone() -> None:
    """The CPU path (SDPA with a dense mask; forward and gradients) and the GPU path's mask_mod (FlexAttention's
    BlockMask, run here eagerly: forward only, as CPU allows) equal causal attention over each document alone."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # The template's file name ends in jinja, not .py: name its loader.
    loader = importlib.machinery.SourceFileLoader("document_attention_under_test", str(ATTENTION_PY))
    attention = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(attention)
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, head_dim = 3, 4, 2, 150, 8  # seq over one 128-token block, not a multiple
    starts = torch.rand(batch, seq, generator=generator) < 0.05
    starts[:, 0] = True
    document_ids = starts.long().cumsum(1)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=generator, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    dense = attention.attention(q, k, v, attention.document_mask(document_ids), enable_gqa=True)
    reference = torch.zeros_like(dense)
    for row in range(batch):
        for document in document_ids[row].unique():
            at = (document_ids[row] == document).nonzero().flatten()
            reference[row, :, at] = F.scaled_dot_product_attention(
                q[row : row + 1, :, at], k[row : row + 1, :, at], v[row : row + 1, :, at], is_causal=True,
                enable_gqa=True,
            )[0]  # fmt: skip
    assert (dense - reference).abs().max().item() < 1e-6
    weights = torch.randn(dense.shape, generator=generator)
    gradients = [torch.autograd.grad((out * weights).sum(), (q, k, v)) for out in (dense, reference)]
    for mine, theirs in zip(*gradients, strict=True):
        assert (mine - theirs).abs().max().item() < 1e-5
    block_mask = create_block_mask(attention.document_causal(document_ids), batch, None, seq, seq, device="cpu")
    with torch.no_grad():
        flex = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask, enable_gqa=True)
    assert (flex - reference.detach()).abs().max().item() < 1e-6
    # Without document ids: plain causal attention over the whole row.
    plain = attention.attention(q, k, v, attention.document_mask(None), enable_gqa=True)
    assert torch.equal(plain, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


# ---- SFT (hf family only): each conversation is a document -------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_prepare_chat_makes_each_conversation_a_document(tmp_path: Path) -> None:
    """prepare_chat.py's .docs marks every conversation's first token, and the loader restarts positions there:
    a conversation is context (mask 0) then the assistant's reply (mask 1), so its start is where 1 turns to 0."""
    from tests.conftest import save_tiny_llama

    rng = random.Random(0)
    with open(tmp_path / "chats.jsonl", "w") as lines:
        for _ in range(120):
            prompt, reply = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(2))
            lines.write(json.dumps({"prompt": prompt, "response": reply}) + "\n")
    special = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")
    model = save_tiny_llama(tmp_path / "model", " ".join(WORDS) * 20, special, chat_template=CHAT_TEMPLATE)
    project = generate(tmp_path / "run", "--family", "hf", "--hf-model", str(model), "--task", "sft", "--gpus", "2")
    # One process, nothing distributed: run in this one (captured_in_this_process; transformers is imported here
    # already, for the model above), not a process that imports torch and transformers again.
    code, _, stderr = captured_in_this_process(project, "scripts/prepare_chat.py", str(tmp_path / "chats.jsonl"),
                                               "--output", str(tmp_path / "data"), "--val-fraction", "0",
                                               "--shard-tokens", "1000")  # fmt: skip
    assert code == 0, stderr
    data = tmp_path / "data"
    index = json.loads((data / "index.json").read_text())
    assert index["documents"] is True and index["masks"] is True and len(index["train"]) > 1
    for shard in index["train"]:
        mask = np.fromfile(data / shard["mask_file"], dtype=np.uint8)
        starts = [0, *(np.flatnonzero((mask[:-1] == 1) & (mask[1:] == 0)) + 1)]
        assert np.fromfile(data / shard["docs_file"], dtype=np.int64).tolist() == starts
    seq_len = 32
    samples = DATA.TokenShards(data, "train", seq_len, documents=True)
    [batch] = DATA.micro_batches(samples, 0, 16, 1, 0, 1)
    rows = np.stack([samples[i] for i in range(16)]).astype(np.int64)
    mask, starts = rows[:, 1], rows[:, 2]
    assert (batch.positions.numpy()[starts[:, :-1] == 1] == 0).all()
    assert ((batch.positions.numpy() == 0) == ((starts[:, :-1] == 1) | (np.arange(seq_len) == 0))).all()
    # Targets: the reply's tokens only (the next conversation's first token is context, mask 0, anyway).
    expected = np.where((mask[:, 1:] == 1) & (starts[:, 1:] == 0), rows[:, 0, 1:], DATA.IGNORE)
    assert batch.targets.tolist() == expected.tolist()
    # With data.document_mask false: (tokens, mask) only, no positions or ids.
    [plain] = DATA.micro_batches(DATA.TokenShards(data, "train", seq_len), 0, 16, 1, 0, 1)
    assert plain.positions is None and plain.document_ids is None
    assert plain.inputs.tolist() == batch.inputs.tolist() and plain.targets.tolist() == batch.targets.tolist()
    # A pretrain project refuses chat data (it would train on the prompts too), in one line naming the fix.
    pretrain = load_data_module("pretrain")
    with pytest.raises(pretrain.DataError) as refused:
        pretrain.check_prepared_folder(data, seq_len, vocab_size=1 << 20)
    assert str(refused.value) == (
        f"data.path {data} holds chat data with a loss mask, which only a project generated with --task sft trains "
        "on; prepare plain text with scripts/prepare_data.py"
    )


@settings(max_examples=80, deadline=None)
@given(
    offsets=st.lists(st.integers(-3, 40), max_size=8),
    ordered=st.booleans(),
    tokens=st.integers(1, 36),
    extra_bytes=st.integers(0, 9),
)
def test_a_docs_file_is_accepted_only_when_ascending_within_its_shard(
    offsets: list[int], ordered: bool, tokens: int, extra_bytes: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any drawn .docs content: check_docs (preflight's) refuses it in one line unless it is whole int64 offsets,
    strictly ascending, each within the shard's tokens. (`ordered`: sorted, repeats kept: the near misses.)"""
    offsets = sorted(offsets) if ordered else offsets
    folder = tmp_path_factory.mktemp("docs")
    content = np.array(offsets, dtype=np.int64).tobytes() + b"\0" * (extra_bytes % 8 if extra_bytes < 8 else 0)
    (folder / "train-00000.docs").write_bytes(content)
    shard = {"file": "train-00000.bin", "tokens": tokens, "docs_file": "train-00000.docs"}
    valid = len(content) % 8 == 0 and all(0 <= o < tokens for o in offsets) and offsets == sorted(set(offsets))
    try:
        DATA.check_docs(folder, shard, "FIX")
    except DATA.DataError as exc:
        assert not valid
        assert str(exc) == (
            f"data.path {folder}: train-00000.docs is not ascending int64 offsets within its shard of {tokens} "
            "tokens (it is damaged or belongs to another shard); FIX"
        )
    else:
        assert valid
