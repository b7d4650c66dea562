"""Machine-readable use: --json, --dry-run, --answers-file, `questions --json`, closed stdin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO, fsdp2gen, tree


def test_json_report_matches_the_files_on_disk(tmp_path: Path) -> None:
    result = fsdp2gen("new", str(tmp_path / "run"), "--gpus", "2", "--fp32", "--json")
    assert result.returncode == 0 and result.stderr == ""
    report = json.loads(result.stdout)
    assert report["answers"] == {
        "project_name": "run", "family": "llama", "hf_model": "", "gpus": 2, "nodes": 1, "precision": "fp32",
        "checkpoint": "dcp", "launcher": "torchrun", "tp": 1, "moe": False, "ep": 1, "cp": 1, "pp": 1,
        "reshard_after_forward": "true",
        "activation_checkpointing": "none",
        "compile": False, "float8": False, "cpu_offload": False, "prefetch": False, "tensorboard": False,
        "tokenizer": "", "task": "pretrain", "qlora": False, "lora": False, "wandb": False,
    }  # fmt: skip
    assert report["defaults_used"] == [
        "family", "nodes", "checkpoint", "launcher", "tp", "moe", "ep", "cp", "pp", "reshard_after_forward",
        "activation_checkpointing", "compile", "float8", "cpu_offload", "prefetch", "tensorboard", "tokenizer", "task",
        "qlora", "lora", "wandb",
    ]  # fmt: skip
    assert report["dry_run"] is False and report["dest"] == str(tmp_path / "run")
    assert report["files"] == sorted(tree(tmp_path / "run"))
    assert report["next"][0] == {"command": f"cd {tmp_path / 'run'}", "why": ""}
    assert {"command": "pytest", "why": "the project's own tests"} in report["next"]


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "a" / "run"
    result = fsdp2gen("new", str(dest), "-y", "--dry-run", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["files"][:3] == [".copier-answers.yml", ".github/workflows/ci.yml", ".gitignore"]
    assert list(tmp_path.iterdir()) == []
    text = fsdp2gen("new", str(dest), "-y", "--dry-run")
    assert text.stdout.startswith(f"Would create {dest} (")
    assert list(tmp_path.iterdir()) == []


def test_errors_under_json_are_one_json_object(tmp_path: Path) -> None:
    for options, message in (
        (["--gpus", "0"], "--gpus: must be at least 1, e.g. --gpus 8"),
        (["--gpus", "abc"], "Invalid value for '--gpus': "),
    ):
        result = fsdp2gen("new", str(tmp_path / "run"), "--json", *options)
        assert result.returncode == 2
        error = json.loads(result.stdout)
        assert error["code"] == 2 and error["error"].startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_answers_file_supplies_answers_and_conflicts_are_errors(tmp_path: Path) -> None:
    answers = tmp_path / "answers.yml"
    answers.write_text("_src_path: ignored\ngpus: 4\nprecision: fp16\n")
    result = fsdp2gen("new", str(tmp_path / "run"), "--answers-file", str(answers), "--nodes", "2", "-y")
    assert result.returncode == 0, result.stderr
    recorded = yaml.safe_load((tmp_path / "run" / ".copier-answers.yml").read_text())
    assert (recorded["gpus"], recorded["precision"], recorded["nodes"]) == (4, "fp16", 2)
    # A flag that agrees with the file is fine; one that contradicts it is not.
    assert fsdp2gen("new", str(tmp_path / "ok"), "--answers-file", str(answers), "--gpus", "4", "-y").returncode == 0
    conflict = fsdp2gen("new", str(tmp_path / "bad"), "--answers-file", str(answers), "--fp32", "-y")
    assert conflict.returncode == 2
    assert (
        conflict.stderr
        == f"fsdp2gen: error: --precision fp32 contradicts precision: fp16 in {answers}; drop one of them\n"
    )
    assert not (tmp_path / "bad").exists()


def test_answers_file_errors(tmp_path: Path) -> None:
    cases = {
        "gpus: 0\n": "gpus in {path}: must be at least 1, e.g. --gpus 8",
        "colour: red\n": "colour in {path}: unknown question; known: project_name, family, hf_model, pretrained, gpus, "
        "nodes, precision, checkpoint, launcher",
        "- gpus\n": "answers file {path} must be a mapping of answers like 'gpus: 8', got a list; pass a YAML file "
        "of answers like 'gpus: 8'",
        "gpus: [\n": "answers file {path} is not valid YAML (",
    }
    for content, message in cases.items():
        path = tmp_path / "answers.yml"
        path.write_text(content)
        result = fsdp2gen("new", str(tmp_path / "run"), "--answers-file", str(path))
        assert result.returncode == 2
        assert result.stderr.startswith("fsdp2gen: error: " + message.format(path=path)), result.stderr
    missing = fsdp2gen("new", str(tmp_path / "run"), "--answers-file", str(tmp_path / "nope.yml"))
    assert (
        missing.stderr
        == f"fsdp2gen: error: cannot read answers file {tmp_path / 'nope.yml'}: No such file or directory; pass a YAML "
        "file of answers like 'gpus: 8'\n"
    )
    assert not (tmp_path / "run").exists()


def test_closed_stdin_never_blocks(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m fsdp2gen new "{tmp_path / "run"}" <&-'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "using defaults family=llama, gpus=8" in result.stderr


def test_questions_json_is_copier_yml(tmp_path: Path) -> None:
    described = json.loads(fsdp2gen("questions", "--json").stdout)
    spec = yaml.safe_load((REPO / "templates" / "copier.yml").read_text())
    asked = [name for name, entry in spec.items() if not name.startswith("_") and entry.get("when") is not False]
    assert [q["name"] for q in described] == asked
    for question in described:
        entry = spec[question["name"]]
        assert question["type"] == entry["type"] and question["default"] == entry["default"]
        assert question["help"] == entry["help"] and question["flag"] == "--" + question["name"].replace("_", "-")
        assert question["choices"] == list((entry.get("choices") or {}).values())
    text = fsdp2gen("questions").stdout
    assert "--precision STR (fp32, bf16, fp16) [default: bf16]" in text
    # Questions for one family say when they apply.
    assert [(q["name"], q["when"]) for q in described if q["when"]] == [
        ("hf_model", "{{ family in ['hf', 'llama'] }}"), ("pretrained", "{{ family == 'hf' }}")
    ]  # fmt: skip


def test_agents_md_states_the_invariants(tmp_path: Path) -> None:
    fsdp2gen("new", str(tmp_path / "bf16"), "-y", "--bf16")
    fsdp2gen("new", str(tmp_path / "fp32"), "-y", "--fp32")
    bf16 = (tmp_path / "bf16" / "AGENTS.md").read_text()
    for block in ("init_distributed", "build_model_meta", "build_optimizer", "train_step", "checkpoint_save",
                  "checkpoint_load"):  # fmt: skip
        assert f"`{block}`" in bf16
    assert "set_requires_gradient_sync(False)" in bf16 and "never `model.forward(x)`" in bf16
    assert '`parallel.reduce_dtype = "float32"`' in bf16
    assert "reduce_dtype" not in (tmp_path / "fp32" / "AGENTS.md").read_text()
