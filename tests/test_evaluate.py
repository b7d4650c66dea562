"""scripts/evaluate.py (family hf), the parts that need no lm-eval run: a new folder per evaluation, bad input,
and the results logged where the checkpoint's run logs (TensorBoard). lm-eval itself runs once, in
tests/test_newcomer_path.py's Hugging Face path (train, export, evaluate as the generated README prints them), which
checks its per-item log-likelihoods against transformers by hand (importing lm_eval costs ~5 CPU-seconds, one
evaluate.py process ~30).

Also here, as they need a Hugging Face project and model folder: the bare tokenizer.json that --tokenizer and
data.tokenizer accept, and preflight's sequence-length line of hf projects.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import generate, project_modules, save_tiny_llama, torchrun_env

TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "red green blue yellow, cat dog bird fish. " * 20


@pytest.fixture(scope="module")
def hf_project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny pretrained Llama with its tokenizer, and an hf project (TensorBoard on) that trains it."""
    root = tmp_path_factory.mktemp("evaluate")
    model = save_tiny_llama(root / "model", TEXT)
    project = generate(root / "run", "--family", "hf", "--hf-model", str(model), "--gpus", "2", "--fp32",
                       "--tensorboard")  # fmt: skip
    return {"root": root, "model": model, "project": project}


@pytest.fixture
def evaluate(hf_project: dict) -> Iterator[ModuleType]:
    """The project's scripts/evaluate.py, imported in this process with the project's modules (forgotten after)."""
    project = hf_project["project"]
    with project_modules(project):
        spec = importlib.util.spec_from_file_location(f"evaluate_{id(project)}", project / "scripts" / "evaluate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


def test_each_evaluation_gets_a_new_folder(evaluate: ModuleType, tmp_path: Path) -> None:
    first, second = (evaluate.new_evaluation_folder(tmp_path, "step-2") for _ in range(2))
    assert first != second and first.parent == second.parent == tmp_path / "evaluations"
    assert second.name == first.name + "-2" or second.name.split("-step")[0] != first.name.split("-step")[0]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{model_parent}", "--tasks", "arc_easy"],
         "is neither a checkpoint (no checkpoint.json) nor a Hugging Face model folder (no config.json); give a "
         "step-N folder or a folder written by scripts/export.py"),
        (["--tasks", "{root}/nameless.yaml"],
         "nameless.yaml declares no `task: NAME`; add one (lm-eval calls a task by it)"),
        (["--tasks", "missing.yaml"],
         "--tasks missing.yaml: no such file; give a task's YAML file or an lm-eval task name"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(hf_project: dict, arguments: list[str], message: str) -> None:
    (hf_project["root"] / "nameless.yaml").write_text("dataset_path: json\noutput_type: multiple_choice\n")
    arguments = [a.format(model_parent=hf_project["model"].parent, root=hf_project["root"]) for a in arguments]
    result = subprocess.run([sys.executable, "scripts/evaluate.py", *arguments], cwd=hf_project["project"],
                            env=torchrun_env(), capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("evaluate.py: error: ") and line.endswith(message), line


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


def test_hf_preflight_names_the_models_position_limit(hf_project: dict) -> None:
    """hf projects have no model.max_seq_len: the limit is config.json's max_position_embeddings."""
    result = subprocess.run([sys.executable, "preflight.py", "--world-size", "1", "--training.seq_len", "128",
                             "--job.device", "cpu"], cwd=hf_project["project"], env=torchrun_env(), capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
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
