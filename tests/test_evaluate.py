"""scripts/evaluate.py (family hf): lm-eval on a checkpoint, a local multiple-choice task defined in the test (a
JSONL file and a YAML task, no network). One evaluate.py process for the module (importing lm_eval alone costs
~5 CPU-seconds): the checkpoint of a 2-step run on 1 process, exported by evaluate.py itself, scored by lm-eval's
HFLM. The reference is transformers by hand on the folder scripts/export.py writes for the same checkpoint.

Also here, as they need a Hugging Face project and model folder: the bare tokenizer.json that --tokenizer and
data.tokenizer accept.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import generate, save_tiny_llama, torchrun, torchrun_env

TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "red green blue yellow, cat dog bird fish. " * 20
ITEMS = [
    {"question": "The quick brown fox", "choices": ["jumps", "cat", "blue"], "answer": 0},
    {"question": "over the lazy", "choices": ["dog", "fish", "red"], "answer": 1},
    {"question": "red green", "choices": ["blue", "dog", "the quick"], "answer": 0},
    {"question": "cat dog", "choices": ["bird", "quick", "lazy fox"], "answer": 2},
    {"question": "yellow", "choices": [", cat", "brown", "over"], "answer": 0},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def hf_project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny pretrained Llama with its tokenizer, and an hf project (TensorBoard on) that trains it."""
    root = tmp_path_factory.mktemp("evaluate")
    model = save_tiny_llama(root / "model", TEXT)
    project = generate(root / "run", "--family", "hf", "--hf-model", str(model), "--gpus", "2", "--fp32",
                       "--tensorboard")  # fmt: skip
    return {"root": root, "model": model, "project": project}


@pytest.fixture(scope="module")
def evaluated(hf_project: dict) -> dict:
    root, model, project = hf_project["root"], hf_project["model"], hf_project["project"]
    out = project / "outputs"
    torchrun(project, "train.py", "--training.steps", "2", "--training.seq_len", "32", "--training.global_batch_size",
             "4", "--job.device", "cpu", "--job.tensorboard", "true", nproc=1)  # fmt: skip
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tasks / "tiny_mc.yaml").write_text(TASK.format(items=tasks / "items.jsonl"))
    env = {**torchrun_env(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "scripts/evaluate.py", "--tasks", str(tasks / "tiny_mc.yaml"), "--dtype", "float32"]
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exported = root / "exported"
    export = [sys.executable, "scripts/export.py", str(out / "checkpoints" / "step-2"), "--output", str(exported)]
    subprocess.run(export, cwd=project, env=torchrun_env(), check=True, capture_output=True)
    return {"project": project, "out": out, "exported": exported, "model": model, "stdout": result.stdout,
            "stderr": result.stderr}  # fmt: skip


def by_hand(folder: Path) -> list[list[float]]:
    """Each item's log-likelihood of each choice (" " + choice after the question), with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = []
    for item in ITEMS:
        context = tokenizer(item["question"], add_special_tokens=False).input_ids
        row = []
        for choice in item["choices"]:
            whole = tokenizer(item["question"] + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            row.append(sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context), len(whole))))
        scores.append(row)
    return scores


def test_per_item_log_likelihoods_and_accuracy_are_transformers_by_hand(evaluated: dict) -> None:
    (folder,) = (evaluated["out"] / "evaluations").iterdir()
    samples = [json.loads(line) for line in (folder / "samples_tiny_mc.jsonl").read_text().splitlines()]
    lm_eval = [
        [choice[0] for choice in sample["filtered_resps"]] for sample in sorted(samples, key=lambda s: s["doc_id"])
    ]
    reference = by_hand(evaluated["exported"])
    assert len(lm_eval) == len(ITEMS) and all(len(row) == 3 for row in lm_eval)
    for ours, theirs in zip(lm_eval, reference, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5, rel=0)
    # The trained model, not the pretrained one: two steps moved the log-likelihoods.
    pretrained = [value for row in by_hand(evaluated["model"]) for value in row]
    assert max(abs(a - b) for a, b in zip(pretrained, sum(reference, []), strict=True)) > 1e-4
    accuracy = sum(row.index(max(row)) == item["answer"] for row, item in zip(reference, ITEMS, strict=True)) / len(
        ITEMS
    )
    results = json.loads((folder / "results.json").read_text())
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
    # One line per task in the run's evaluations.jsonl, with the run and step, and the score in TensorBoard.
    (row,) = [json.loads(line) for line in (evaluated["out"] / "evaluations.jsonl").read_text().splitlines()]
    run_id = json.loads((evaluated["out"] / "run.json").read_text())["run_id"]
    assert (row["run_id"], row["step"], row["task"]) == (run_id, 2, "tiny_mc")
    assert row["metrics"]["acc"] == pytest.approx(accuracy)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(evaluated["out"] / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/tiny_mc/acc")] == [(2, pytest.approx(accuracy))]
    # lm-eval's progress bar, and the temporary export is gone.
    assert "Running loglikelihood requests" in evaluated["stderr"]
    assert sorted(p.name for p in folder.iterdir()) == ["results.json", "samples_tiny_mc.jsonl"]


def evaluate_module(project: Path):
    spec = importlib.util.spec_from_file_location(f"evaluate_{id(project)}", project / "scripts" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_evaluation_gets_a_new_folder(hf_project: dict, tmp_path: Path) -> None:
    module = evaluate_module(hf_project["project"])
    first, second = (module.new_evaluation_folder(tmp_path, "step-2") for _ in range(2))
    assert first != second and first.parent == second.parent == tmp_path / "evaluations"
    assert second.name == first.name + "-2" or second.name.split("-step")[0] != first.name.split("-step")[0]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{model_parent}", "--tasks", "arc_easy"],
         "is neither a checkpoint (no checkpoint.json) nor a Hugging Face model folder (no config.json); give a "
         "step-N folder or a folder written by scripts/export.py"),
        (["--tasks", "missing.yaml"],
         "--tasks missing.yaml: no such file; give a task's YAML file or an lm-eval task name"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(hf_project: dict, arguments: list[str], message: str) -> None:
    arguments = [a.format(model_parent=hf_project["model"].parent) for a in arguments]
    result = subprocess.run([sys.executable, "scripts/evaluate.py", *arguments], cwd=hf_project["project"],
                            env=torchrun_env(), capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("evaluate.py: error: ") and line.endswith(message), line


def test_a_bare_tokenizer_json_or_its_folder_loads_as_the_models_tokenizer(hf_project: dict, tmp_path: Path) -> None:
    """--tokenizer path/tokenizer.json (documented) and a folder with only tokenizer.json, in an hf project."""
    spec = importlib.util.spec_from_file_location("hf_tokenizer", hf_project["project"] / "tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    full = module.load_tokenizer(str(hf_project["model"]))
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "tokenizer.json").write_bytes((hf_project["model"] / "tokenizer.json").read_bytes())
    for spec_ in (str(hf_project["model"] / "tokenizer.json"), str(alone)):
        bare = module.load_tokenizer(spec_)
        assert (bare.eos_id, bare.vocab_size) == (full.eos_id, full.vocab_size)
        assert bare.encode("the lazy dog, red fish") == full.encode("the lazy dog, red fish")
