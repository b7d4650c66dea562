"""Training on real text, end to end, offline: a corpus written here, a BPE tokenizer trained here with
`tokenizers`, scripts/prepare_data.py into shards, then 2 gloo ranks with a validation loss, W&B in offline
mode, a profiler trace, and resume across shard boundaries. For the built-in llama family and for hf.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import generate, metrics, save_tiny_llama, torchrun
from tests.helpers.in_process import script_in_this_process
from tests.helpers.scripts import captured_in_this_process, run_scripts
from tests.helpers.several_runs import launch_several

WORDS = "the a cat dog bird sat ran flew on under over mat log tree house quickly slowly red blue big small".split()
# A tiny llama: a step takes well under a second on 2 CPU ranks.
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "172", "--model.max_seq_len", "64"]  # fmt: skip
TRAIN = ["--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "2",
         "--training.lr", "1e-2", "--job.device", "cpu", "--job.log_every", "1", "--eval.batches", "2"]  # fmt: skip


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two text files and a JSON-lines file (about 100 KB, 13 pieces of ~8 KiB), and a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text("\n".join(sentences(1200, 0)) + "\n")
    (root / "text" / "b.md").write_text("\n".join(sentences(600, 1)) + "\n")
    with open(root / "docs.jsonl", "w") as docs:
        for number in range(200):
            docs.write(json.dumps({"id": number, "text": " ".join(sentences(3, 100 + number))}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(p) for p in sorted((root / "text").iterdir())], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return {"root": root, "tokenizer": root / "tokenizer.json"}


def prepare(project: Path, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python scripts/prepare_data.py ARGS` in `project`, run in this process
    (captured_in_this_process: one process, nothing distributed; a process of its own would import torch again)."""
    return captured_in_this_process(project, "scripts/prepare_data.py", *args)


@pytest.fixture(scope="module")
def llama(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A llama project with the tokenizer and W&B, and the corpus prepared in shards of 4000 tokens."""
    project = generate(tmp_path_factory.mktemp("llama") / "run", "--gpus", "2", "--fp32", "--tokenizer",
                       str(corpus["tokenizer"]), "--wandb")  # fmt: skip
    data = project.parent / "data"
    code, _, stderr = prepare(project, str(corpus["root"] / "text"), str(corpus["root"] / "docs.jsonl"), "--output",
                              str(data), "--val-fraction", "0.2", "--shard-tokens", "4000")  # fmt: skip
    assert code == 0, stderr
    return {"project": project, "data": data}


def test_the_tokenizer_sets_the_vocabulary_and_the_shards_hold_the_text(corpus: dict, llama: dict) -> None:
    from tokenizers import Tokenizer

    config = (llama["project"] / "config.toml").read_text()
    assert f'tokenizer = "{corpus["tokenizer"]}"' in config
    index = json.loads((llama["data"] / "index.json").read_text())
    tokenizer = Tokenizer.from_file(str(corpus["tokenizer"]))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert (index["vocab_size"], index["eos_id"], index["dtype"], index["complete"]) == (300, eos, "uint16", True)
    assert len(index["train"]) >= 5 and len(index["val"]) >= 2, index
    shards = {split: [np.fromfile(llama["data"] / s["file"], dtype=np.uint16) for s in index[split]]
              for split in ("train", "val")}  # fmt: skip
    for split in shards:
        assert [len(tokens) for tokens in shards[split]] == [s["tokens"] for s in index[split]]
        assert [int(tokens.max()) for tokens in shards[split]] == [s["max_id"] for s in index[split]]
    # One end-of-text token per document: 2 text files + 200 JSON lines.
    assert sum(int((tokens == eos).sum()) for split in shards for tokens in shards[split]) == 202
    train_text = tokenizer.decode(np.concatenate(shards["train"]).tolist(), skip_special_tokens=False)
    assert train_text.startswith(sentences(1, 0)[0])  # the first piece of a.txt
    # About a fifth of the text is held out for validation, in whole pieces.
    val_tokens, train_tokens = sum(map(len, shards["val"])), sum(map(len, shards["train"]))
    assert 0.1 < val_tokens / (val_tokens + train_tokens) < 0.3


def test_an_interrupted_preparation_resumes_to_the_same_shards(corpus: dict, llama: dict, tmp_path: Path) -> None:
    # What an interruption leaves: index.json as published when the 3rd train shard ended (its pieces_end),
    # the shards it lists, and a half-written next shard.
    complete = json.loads((llama["data"] / "index.json").read_text())
    pieces_done = complete["train"][2]["pieces_end"]
    interrupted = tmp_path / "data"
    shutil.copytree(llama["data"], interrupted)
    kept = {split: [s for s in complete[split] if s["pieces_end"] <= pieces_done] for split in ("train", "val")}
    for shard in complete["train"] + complete["val"]:
        if shard not in kept["train"] + kept["val"]:
            (interrupted / shard["file"]).unlink()
    (interrupted / "train-00003.bin.tmp").write_bytes(b"\x01\x02\x03")
    (interrupted / "index.json").write_text(json.dumps({**complete, **kept, "pieces_done": pieces_done,
                                                        "complete": False}))  # fmt: skip
    command = ["scripts/prepare_data.py", str(corpus["root"] / "text"), str(corpus["root"] / "docs.jsonl"), "--output",
               str(interrupted), "--val-fraction", "0.2", "--shard-tokens", "4000"]  # fmt: skip
    # The resumed preparation, then the same command again on the finished folder: one Python process (run_scripts).
    result, again = run_scripts(llama["project"], command, command)
    assert result[0] == 0, result[2]
    # What the first run left is what the second found: the folder as of now, the second run having changed nothing.
    assert json.loads((interrupted / "index.json").read_text()) == complete
    for shard in complete["train"] + complete["val"]:
        assert (interrupted / shard["file"]).read_bytes() == (llama["data"] / shard["file"]).read_bytes()
    assert sorted(p.name for p in interrupted.iterdir()) == sorted(p.name for p in llama["data"].iterdir())
    # Run again on a finished folder: nothing changes.
    assert again[0] == 0 and "already prepared" in again[1], again


def test_parquet_and_datasets_folders_give_the_tokens_of_the_same_jsonl(corpus: dict, llama: dict, tmp_path: Path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in (corpus["root"] / "docs.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"id": [r["id"] for r in records], "body": [r["text"] for r in records]}),
                   tmp_path / "docs.parquet")  # fmt: skip
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(tmp_path / "docs-dataset")
    inputs = {
        "jsonl": [str(corpus["root"] / "docs.jsonl")],
        "parquet": [str(tmp_path / "docs.parquet"), "--text-field", "body"],
        "datasets": [str(tmp_path / "docs-dataset")],
    }
    # The three preparations in one Python process (run_scripts: pyarrow and datasets imported once).
    results = run_scripts(llama["project"], *[
        ["scripts/prepare_data.py", *args, "--output", str(tmp_path / name), "--val-fraction", "0.2"]
        for name, args in inputs.items()
    ])  # fmt: skip
    shards = {}
    for name, result in zip(inputs, results, strict=True):
        assert result[0] == 0, result[2]
        shards[name] = [
            (tmp_path / name / f).read_bytes() for f in sorted(p.name for p in (tmp_path / name).glob("*.bin"))
        ]
    assert shards["parquet"] == shards["jsonl"] and shards["datasets"] == shards["jsonl"]
    assert len(shards["jsonl"]) == 2  # a train and a val shard


def wandb_history(output_dir: Path) -> list[tuple[str, list[dict], tuple[str, float] | None]]:
    """(run id, logged rows, the (run, step) it rewinds, if any) of each offline W&B run under output_dir/wandb,
    oldest first.

    A .wandb file is W&B's record log (LevelDB's log format: 32 KiB blocks of records with a 7-byte header)
    of protobuf Records; wandb itself no longer ships a Python reader.
    """
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, position, pending, rows, run_id, rewinds = path.read_bytes(), 7, b"", [], None, None
        assert data[:4] == b":W&B"
        while position + 7 <= len(data):
            left = 32768 - position % 32768
            _, length, kind = struct.unpack("<IHB", data[position : position + 7])
            if left < 7 or kind == 0:
                position += left  # block padding
                continue
            pending += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):  # a full record, or the last part of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "run":
                    run_id = record.run.run_id
                    if record.run.HasField("branch_point"):
                        rewinds = (record.run.branch_point.run, record.run.branch_point.value)
                elif record.WhichOneof("record_type") == "history":
                    items = record.history.item
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
        runs.append((run_id, rows, rewinds))
    return runs


def test_llama_trains_on_text_with_validation_wandb_and_a_profile(llama: dict, tmp_path: Path) -> None:
    project, out = llama["project"], tmp_path / "out"
    common = [*TINY, *TRAIN, "--data.path", str(llama["data"]), "--wandb.mode", "offline", "--eval.every", "4"]
    # Both runs in one launch (tests/helpers/several_runs.py: train.train() per run, each with its own config, seed
    # and output folder): the first, then its resume (checked below) from the folder as a crash during step 5
    # would leave it, a copy without the step-8 checkpoint and with the metrics of steps 1-4.
    resumed = tmp_path / "resumed"
    interrupted = {"from": str(out), "remove": ["checkpoints/step-8"], "metrics_lines": 4}
    both = launch_several(project, [
        [*common, "--job.output_dir", str(out), "--training.steps", "8", "--checkpoint.interval", "4",
         "--profile.start", "2", "--profile.steps", "2"],
        {"args": [*common, "--job.output_dir", str(resumed), "--training.steps", "8", "--checkpoint.interval", "4"],
         "interrupted": interrupted},
    ], tmp_path / "runs.json", nproc=2)  # fmt: skip
    first, second = both.stdout.split("\nrun 1: ")
    assert "data: " + str(llama["data"]) in first
    # model.vocab_size followed data.tokenizer (300 tokens): the config.toml of the project sets none.
    saved = json.loads((out / "checkpoints" / "step-8" / "checkpoint.json").read_text())
    assert saved["config"]["model"]["vocab_size"] == 300
    records = metrics(out)
    validation = [r["val_loss"] for r in records if "val_loss" in r]
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]
    assert validation[1] < validation[0] - 0.3, validation  # the model learns the text, not just the batches
    assert all(abs(r["val_perplexity"] - np.exp(r["val_loss"])) < 1e-6 * r["val_perplexity"] for r in records
               if "val_loss" in r)  # fmt: skip

    # A profiler trace per rank of steps 2-3, naming the model's ops and FSDP's collectives.
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"steps-2-3-rank-{rank}.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"aten::embedding", "aten::mm", "FSDP::all_gather (layers.0)"} <= names

    # W&B (offline): the run id is the run's, and it logged exactly what metrics.jsonl holds.
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    [(wandb_run_id, rows, rewinds)] = wandb_history(out)
    assert rewinds is None
    assert wandb_run_id == run_id
    assert [(row["_step"], row["loss"], row.get("val_loss")) for row in rows] == [
        (r["step"], r["loss"], r.get("val_loss")) for r in records
    ]

    # Resume from the step-4 checkpoint (as after a crash during step 5) repeats steps 5-8 bit for bit, though
    # every batch crosses shard boundaries, and logs into the same W&B run.
    assert f"resumed from {resumed}/checkpoints/step-4 at step 4" in second
    again = metrics(resumed)
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in again] == [
        (r["step"], r["loss"], r.get("val_loss")) for r in records
    ]
    runs = wandb_history(resumed)
    assert [run for run, _, _ in runs] == [run_id, run_id]
    assert [row["_step"] for row in runs[1][1]] == [5, 6, 7, 8]
    # The resumed launch rewinds the W&B run to its checkpoint's step (resume_from): W&B drops the first launch's
    # steps 5-8 (when `wandb sync` uploads these offline runs), so each step shows once.
    assert runs[1][2] == (run_id, 4.0)

    # The same checkpoint resumed on one process (resharded by DCP) reads the same samples: the same losses. And
    # one process trains the same model on the same samples from the start. (Both one process without torchrun,
    # one after the other in this test's own process: script_in_this_process.)
    resharded, single = tmp_path / "resharded", tmp_path / "single"
    shutil.copytree(resumed, resharded)
    shutil.rmtree(resharded / "checkpoints" / "step-8")
    (resharded / "metrics.jsonl").write_text("".join((out / "metrics.jsonl").read_text().splitlines(True)[:4]))
    script_in_this_process(project, "train.py", *common, "--job.output_dir", str(resharded), "--training.steps", "8",
                           "--checkpoint.interval", "4", "--job.wandb", "false")  # fmt: skip
    script_in_this_process(project, "train.py", *common, "--job.output_dir", str(single), "--training.steps", "8",
                           "--job.wandb", "false")  # fmt: skip
    one = [(r["step"], r["loss"]) for r in metrics(resharded)][4:]
    assert [step for step, _ in one] == [5, 6, 7, 8]
    assert all(abs(loss - r["loss"]) <= 1e-5 for (_, loss), r in zip(one, records[4:], strict=True)), one

    # The single process evaluates the same validation samples: the same validation losses (up to summation order).
    one_rank = [r["val_loss"] for r in metrics(single) if "val_loss" in r]
    assert np.allclose(one_rank, validation, rtol=0, atol=1e-5), (one_rank, validation)


def test_hf_trains_on_text_prepared_with_its_own_tokenizer(tmp_path: Path) -> None:
    text = "\n".join(sentences(2000, 7)) + "\n"
    model_dir = save_tiny_llama(tmp_path / "model", text)
    (tmp_path / "corpus.txt").write_text(text)
    project = generate(tmp_path / "run", "--family", "hf", "--hf-model", str(model_dir), "--gpus", "2", "--fp32")
    data = tmp_path / "data"
    common = [*TRAIN, "--data.path", str(data), "--eval.every", "4", "--training.steps", "8"]
    # The preparation, then one process's training (no torchrun), in this test's own process (transformers is
    # imported here already: save_tiny_llama).
    script_in_this_process(project, "scripts/prepare_data.py", str(tmp_path / "corpus.txt"), "--output", str(data),
                           "--val-fraction", "0.2")  # fmt: skip
    script_in_this_process(project, "train.py", *common, "--job.output_dir", str(tmp_path / "one"))
    assert json.loads((data / "index.json").read_text())["tokenizer"] == str(model_dir)
    torchrun(project, "train.py", *common, "--job.output_dir", str(tmp_path / "two"))
    validation = [r["val_loss"] for r in metrics(tmp_path / "two") if "val_loss" in r]
    assert len(validation) == 2 and validation[1] < validation[0] - 0.3, validation
    one_rank = [r["val_loss"] for r in metrics(tmp_path / "one") if "val_loss" in r]
    assert np.allclose(one_rank, validation, rtol=0, atol=1e-5), (one_rank, validation)


BAD_PREPARE = {
    "missing-input": (
        ["{root}/nope.txt"],
        "input {root}/nope.txt does not exist; give text, JSONL or Parquet files, or folders of them",
    ),  # fmt: skip
    "empty-corpus": (["{root}/empty.txt"], "the inputs hold no text ({root}/empty.txt); give files with text"),
    "json-line-without-text": (
        ["{root}/bad.jsonl"],
        '{root}/bad.jsonl:2 has no text field "text" (a string); name the field with --text-field',
    ),
    "unknown-file-kind": (
        ["{root}/model.bin"],
        "input {root}/model.bin: unknown kind of file; give .txt, .md, .jsonl, .json or .parquet files",
    ),  # fmt: skip
    "tokenizer-larger-than-model": (
        ["{root}/text", "--config", "{root}/small-vocab.toml"],
        "the tokenizer {tokenizer} has 300 tokens but model.vocab_size is 128: its ids would not fit the embedding; "
        "use the model's tokenizer or a larger model.vocab_size",
    ),
    "tokenizer-missing": (
        ["{root}/text", "--tokenizer", "{root}/nope.json"],
        "data.tokenizer {root}/nope.json: {root}/nope.json does not exist; give a tokenizer.json, its folder, or a "
        "hub id",
    ),
    "output-holds-other-files": (
        ["{root}/text", "--output", "{root}/text"],
        "{root}/text exists and is not an empty folder; give a new --output folder",
    ),  # fmt: skip
    "too-little-text-for-validation": (
        ["{root}/text/b.md", "--val-fraction", "0.01"],
        "no text went to the validation split (the corpus has fewer than 100 pieces of ~8 KiB); raise "
        "--val-fraction, or pass --val-fraction 0 and set --eval.every 0 when training",
    ),
}


@pytest.fixture(scope="module")
def bad_prepare_results(corpus: dict, llama: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """{case: (exit code, stdout, stderr, its --output folder)} of `python scripts/prepare_data.py ARGS` for every
    case of BAD_PREPARE, all run in ONE Python process (run_scripts: one import of the script's libraries, not 8)."""
    root = corpus["root"]
    (root / "empty.txt").write_text("")
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    (root / "model.bin").write_bytes(b"\x00")
    config = (llama["project"] / "config.toml").read_text()
    (root / "small-vocab.toml").write_text(config.replace("[model]\n", "[model]\nvocab_size = 128\n"))
    folder = tmp_path_factory.mktemp("bad-prepare")
    runs, outputs = [], {}
    for case, (args, _) in BAD_PREPARE.items():
        args = [arg.format(root=root) for arg in args]
        outputs[case] = folder / case / "data"
        if "--output" not in args:
            args += ["--output", str(outputs[case])]
        runs.append(["scripts/prepare_data.py", *args])
    results = run_scripts(llama["project"], *runs)
    return {case: (*result, outputs[case]) for case, result in zip(BAD_PREPARE, results, strict=True)}


@pytest.mark.parametrize("case", BAD_PREPARE)
def test_prepare_data_refuses_bad_input_in_one_line(case: str, corpus: dict, bad_prepare_results: dict) -> None:
    code, _, stderr, output = bad_prepare_results[case]
    message = BAD_PREPARE[case][1].format(root=corpus["root"], tokenizer=corpus["tokenizer"])
    assert (code, stderr.splitlines()[-1]) == (2, f"prepare_data.py: error: {message}")
    assert not output.exists()  # nothing half-written
