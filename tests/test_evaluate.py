"""scripts/evaluate.py. Family hf, the parts that need no lm-eval run: a new folder per evaluation, bad input,
and the results logged where the checkpoint's run logs (TensorBoard). lm-eval itself runs on an hf project in
tests/test_newcomer_path.py's Hugging Face path (train, export, evaluate as the generated README prints them), and
here on a built-in llama's checkpoint (started from a Llama 3.1-style Hugging Face folder, exported with
export.py --format hf), in this process and in two gloo ranks under torchrun (evaluate.py --nproc 2, the path of
N GPUs): both check its per-item log-likelihoods against transformers by hand (importing lm_eval costs ~5
CPU-seconds, one evaluate.py process ~15, a 2-rank one ~30).

Also here, as they need a Hugging Face project and model folder: the bare tokenizer.json that --tokenizer and
data.tokenizer accept, and preflight's sequence-length line of hf projects.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import generate, metrics, project_modules, save_tiny_llama
from tests.helpers.scripts import captured_in_this_process, run_scripts
from tests.test_hf_llama import LLAMA3_ROPE
from tests.test_newcomer_path import ITEMS, TASK, log_likelihoods_by_hand

TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "red green blue yellow, cat dog bird fish. " * 20


@pytest.fixture(scope="module")
def hf_project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny pretrained Llama with its tokenizer, and an hf project (TensorBoard on) that trains it."""
    root = tmp_path_factory.mktemp("evaluate")
    model = save_tiny_llama(root / "model", TEXT)
    project = generate(root / "run", "--family", "hf", "--hf-model", str(model), "--gpus", "2", "--fp32",
                       "--tensorboard")  # fmt: skip
    return {"root": root, "model": model, "project": project}


@contextmanager
def evaluate_script(project: Path) -> Iterator[ModuleType]:
    """`project`'s scripts/evaluate.py, imported in this process with the project's modules (forgotten after)."""
    with project_modules(project):
        spec = importlib.util.spec_from_file_location(f"evaluate_{id(project)}", project / "scripts" / "evaluate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.fixture
def evaluate(hf_project: dict) -> Iterator[ModuleType]:
    with evaluate_script(hf_project["project"]) as module:
        yield module


def test_each_evaluation_gets_a_new_folder(evaluate: ModuleType, tmp_path: Path) -> None:
    first, second = (evaluate.new_evaluation_folder(tmp_path, "step-2") for _ in range(2))
    assert first != second and first.parent == second.parent == tmp_path / "evaluations"
    assert second.name == first.name + "-2" or second.name.split("-step")[0] != first.name.split("-step")[0]


BAD_INPUT = [
    (["{model_parent}", "--tasks", "arc_easy"],
     "is neither a checkpoint (no checkpoint.json) nor a Hugging Face model folder (no config.json); give a "
     "step-N folder or a folder written by scripts/export.py"),
    (["--tasks", "{root}/nameless.yaml"],
     "nameless.yaml declares no `task: NAME`; add one (lm-eval calls a task by it)"),
    (["--tasks", "missing.yaml"],
     "--tasks missing.yaml: no such file; give a task's YAML file or an lm-eval task name"),
]  # fmt: skip


@pytest.fixture(scope="module")
def refused(hf_project: dict) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `python scripts/evaluate.py ARGS` for each of BAD_INPUT's arguments, then of
    `python preflight.py` with a sequence longer than the model's positions: one after the other in ONE Python
    process (run_scripts), as the scripts run alone."""
    (hf_project["root"] / "nameless.yaml").write_text("dataset_path: json\noutput_type: multiple_choice\n")
    runs = [["scripts/evaluate.py", *(a.format(model_parent=hf_project["model"].parent, root=hf_project["root"])
                                      for a in arguments)] for arguments, _ in BAD_INPUT]  # fmt: skip
    preflight = ["preflight.py", "--world-size", "1", "--training.seq_len", "128", "--job.device", "cpu"]
    return run_scripts(hf_project["project"], *runs, preflight)


@pytest.mark.parametrize("case", range(len(BAD_INPUT)))
def test_bad_input_is_one_line_and_exit_2(refused: list, case: int) -> None:
    code, stdout, stderr = refused[case]
    assert code == 2 and stdout == ""
    (line,) = stderr.strip().splitlines()
    assert line.startswith("evaluate.py: error: ") and line.endswith(BAD_INPUT[case][1]), line


def test_scores_are_logged_with_the_run_in_tensorboard_and_evaluations_jsonl(
    evaluate: ModuleType, tmp_path: Path
) -> None:
    """write_results on lm-eval's results of a checkpoint (the shape simple_evaluate returns): results.json and the
    samples file created anew, a line in evaluations.jsonl, and eval/<task>/<metric> at the checkpoint's step in the
    run's TensorBoard folder (read back with TensorBoard's own reader)."""
    run = tmp_path / "outputs"
    folder = evaluate.new_evaluation_folder(run, "step-7")
    results = {
        "results": {"tiny_mc": {"alias": "tiny_mc", "acc,none": 0.6, "acc_stderr,none": 0.2, "sample_len": 5}},
        "samples": {"tiny_mc": [{"doc_id": 0, "filtered_resps": [[-1.5, False], [-2.5, False]], "acc": 1.0}]},
    }
    source = {
        "model": "outputs/checkpoints/step-7",
        "step": 7,
        "run_id": "abc",
        "config": {"job": {"tensorboard": True}},
    }
    evaluate.write_results(dict(results), folder, source)
    assert json.loads((folder / "results.json").read_text())["results"]["tiny_mc"]["acc,none"] == 0.6
    assert json.loads((folder / "samples_tiny_mc.jsonl").read_text())["filtered_resps"][0] == [-1.5, False]
    (row,) = [json.loads(line) for line in (run / "evaluations.jsonl").read_text().splitlines()]
    assert row == {"run_id": "abc", "step": 7, "model": "outputs/checkpoints/step-7", "task": "tiny_mc",
                   "metrics": {"acc": 0.6, "acc_stderr": 0.2}, "folder": str(folder)}  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/tiny_mc/acc")] == [(7, pytest.approx(0.6))]
    # Never over an earlier evaluation's files: writing into the same folder again is refused (exclusive creation).
    with pytest.raises(FileExistsError):
        evaluate.write_results(dict(results), folder, source)


def test_hf_preflight_names_the_models_position_limit(refused: list) -> None:
    """hf projects have no model.max_seq_len: the limit is config.json's max_position_embeddings."""
    code, _, stderr = refused[-1]  # the refused fixture's preflight.py run
    assert code == 2
    assert stderr.strip().splitlines()[-1] == (
        "preflight.py: error: training.seq_len (128) exceeds config.json's max_position_embeddings (64); "
        "use --training.seq_len 64 or less"
    )


def test_a_bare_tokenizer_json_or_its_folder_loads_as_the_models_tokenizer(hf_project: dict, tmp_path: Path) -> None:
    """--tokenizer path/tokenizer.json (documented) and a folder with only tokenizer.json, in an hf project."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "tokenizer.json").write_bytes((hf_project["model"] / "tokenizer.json").read_bytes())
    with project_modules(hf_project["project"]):
        tokenizer = importlib.import_module("tokenizer")
        full = tokenizer.load_tokenizer(str(hf_project["model"]))
        for bare_path in (str(hf_project["model"] / "tokenizer.json"), str(alone)):
            bare = tokenizer.load_tokenizer(bare_path)
            assert (bare.eos_id, bare.vocab_size) == (full.eos_id, full.vocab_size)
            assert bare.encode("the lazy dog, red fish") == full.encode("the lazy dog, red fish")


def test_a_llama_checkpoint_is_exported_to_hugging_face_format_and_scored_as_transformers_scores_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The built-in llama started from a tiny Llama with Llama 3.1's rotary scaling, trained 2 steps in one process
    (TensorBoard on), exported by hand with export.py --format hf; a local multiple-choice task. evaluate.py (in this
    process) on the exported folder, in this one process; then on the newest checkpoint with --nproc 2: exported by
    export.py --format hf into a temporary folder, scored by two gloo ranks under torchrun (lm-eval's data-parallel
    path, as on two GPUs), each scoring its share of the items. Both give transformers' per-item log-likelihoods by
    hand (1e-5) on the exported folder and its accuracy; each evaluation writes its results once, the checkpoint's
    logged at its step with the run (a line in evaluations.jsonl, one TensorBoard scalar), the temporary export
    gone."""
    hub = save_tiny_llama(tmp_path / "model", TEXT, rope_parameters=LLAMA3_ROPE)
    project = generate(tmp_path / "run", "--family", "llama", "--hf-model", str(hub), "--gpus", "1", "--fp32",
                       "--tensorboard")  # fmt: skip
    out = tmp_path / "outputs"
    train = ["train.py", "--job.device", "cpu", "--job.output_dir", str(out), "--training.steps", "2",
             "--training.seq_len", "32", "--training.global_batch_size", "4", "--training.warmup_steps", "1",
             "--training.lr", "1e-2", "--eval.every", "0"]  # fmt: skip
    # One process, a group of one: run in this process (captured_in_this_process), not a process that imports torch
    # again; what is compared below is the export's scores against transformers', whatever the trained weights.
    code, stdout, stderr = captured_in_this_process(project, *train)
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tasks / "tiny_mc.yaml").write_text(TASK.format(items=tasks / "items.jsonl"))
    exported = tmp_path / "exported"
    with pytest.MonkeyPatch.context() as patch, evaluate_script(project) as evaluate:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("OMP_NUM_THREADS", "1")  # the torchrun ranks below: one thread each on 2 cores
        # A run on token ids (no data.tokenizer) cannot be scored on text: one line, before anything is exported.
        no_tokenizer = tmp_path / "no-tokenizer" / "checkpoints" / "step-2"
        no_tokenizer.mkdir(parents=True)
        record = json.loads((out / "checkpoints" / "step-2" / "checkpoint.json").read_text())
        record["config"]["data"]["tokenizer"] = ""
        (no_tokenizer / "checkpoint.json").write_text(json.dumps(record))
        with pytest.raises(evaluate.EvaluateError, match=r"step-2 was trained without a tokenizer \(data.tokenizer "
                           r"is empty: token ids\), and lm-eval scores text; give the tokenizer its token ids come "
                           r"from with --tokenizer \(a folder or hub id\)$"):  # fmt: skip
            evaluate.run(evaluate.parse_args([str(no_tokenizer), "--tasks", str(tasks / "tiny_mc.yaml")]))
        assert not (tmp_path / "no-tokenizer" / "evaluations").exists()

        patch.setattr(sys, "argv", ["export.py", str(out / "checkpoints" / "step-2"), "--output", str(exported),
                                    "--format", "hf"])  # fmt: skip
        runpy.run_path(str(project / "scripts" / "export.py"), run_name="__main__")
        task = ["--tasks", str(tasks / "tiny_mc.yaml"), "--device", "cpu"]
        # More processes than items: one would score nothing (lm-eval fails in it); one line, nothing written.
        with pytest.raises(evaluate.EvaluateError, match=r"^--nproc 6: task tiny_mc has 5 items and each process "
                           r"needs at least one; use --nproc 5 or fewer$"):  # fmt: skip
            evaluate.run(evaluate.parse_args(["--checkpoints", str(out / "checkpoints"), *task, "--nproc", "6"]))
        assert not (out / "evaluations").exists()
        evaluate.run(evaluate.parse_args([str(exported), "--output-dir", str(out), *task]))
        evaluate.run(evaluate.parse_args(["--checkpoints", str(out / "checkpoints"), *task, "--nproc", "2"]))
    # The work was shared: lm-eval's progress bar (rank 0's only) counted 5 items x 3 choices in one process, and
    # rank 0's 3 items x 3 choices of the two (rank 1 scored the other 2 items, and one repeated to keep pace).
    bars = re.findall(r"Running loglikelihood requests: 100%\|[^|\r\n]*\| (\d+)/\1", capfd.readouterr().err)
    assert list(dict.fromkeys(bars)) == ["15", "9"], bars
    one, two = sorted((out / "evaluations").iterdir(), key=lambda folder: "step-2" in folder.name)
    assert one.name.endswith("-exported") and two.name.endswith("-step-2")
    reference = log_likelihoods_by_hand(exported)
    accuracy = sum(row.index(max(row)) == item["answer"] for row, item in zip(reference, ITEMS, strict=True)) / 5
    for folder in (one, two):
        assert sorted(p.name for p in folder.iterdir()) == ["results.json", "samples_tiny_mc.jsonl"]  # export removed
        samples = [json.loads(x) for x in (folder / "samples_tiny_mc.jsonl").read_text().splitlines()]
        assert [sample["doc_id"] for sample in samples] == [0, 1, 2, 3, 4]  # every item once, in order
        scored = [[choice[0] for choice in sample["filtered_resps"]] for sample in samples]
        for ours, theirs in zip(scored, reference, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-5, rel=0)
        results = json.loads((folder / "results.json").read_text())["results"]
        assert results["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
    # The trained checkpoint, not the folder it started from: training moved the log-likelihoods.
    untrained = [value for row in log_likelihoods_by_hand(hub) for value in row]
    assert max(abs(a - b) for a, b in zip(untrained, sum(reference, []), strict=True)) > 1e-3
    # Written once (by rank 0 of the two): a line per evaluation; the checkpoint's names its run and step.
    rows = [json.loads(x) for x in (out / "evaluations.jsonl").read_text().splitlines()]
    assert [(row["run_id"], row["step"], row["folder"]) for row in rows] == [
        (None, None, str(one)), (metrics(out)[0]["run_id"], 2, str(two))]  # fmt: skip
    assert rows[1]["metrics"]["acc"] == pytest.approx(accuracy)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/tiny_mc/acc")] == [(2, pytest.approx(accuracy))]
