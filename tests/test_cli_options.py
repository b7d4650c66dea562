"""The answer options of `new` and `update` are generated from the template's questions (copier.yml)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from fsdp2gen.cli import app
from fsdp2gen.questions import questions, template_dir


@pytest.mark.parametrize("command_name", ["new", "update"])
def test_every_question_is_an_option_with_its_help(command_name: str) -> None:
    command = typer.main.get_command(app).commands[command_name]
    context = typer.Context(command, info_name=command_name)
    records = {param.name: param.get_help_record(context) for param in command.params}
    for name, question in questions().items():
        if name == "project_name":
            # Declared by hand: `new` derives it from DEST (its help says so), `update` keeps the recorded one.
            assert (name in records) == (command_name == "new")
            continue
        declared, help_text = records[name]
        assert declared.split()[0] == question.flag, declared
        assert help_text.startswith(question.help), help_text
        if question.choices:
            assert declared.endswith(f"<{'|'.join(question.choice_values)}>"), declared
        if question.default != "":
            assert help_text.endswith(f"[default: {question.default}]"), help_text


def test_a_new_question_needs_no_cli_change(tmp_path: Path) -> None:
    """A question added to copier.yml is an option of `new` and `update`, and reaches the answers."""
    template = tmp_path / "templates"
    shutil.copytree(template_dir(), template)
    with (template / "copier.yml").open("a") as spec:
        spec.write("\nwandb:\n  type: bool\n  help: Also log metrics to Weights & Biases\n  default: false\n")
        spec.write("\noptimizer:\n  type: str\n  help: Optimizer\n  choices: [adamw, sgd]\n  default: adamw\n")
    # questions() reads the template once, at import: point it at the copy before the CLI is imported.
    run_cli = (
        "import sys; from pathlib import Path; import fsdp2gen.questions as q\n"
        f"q.template_dir = lambda: Path({str(template)!r})\n"
        "from fsdp2gen.cli import main; sys.argv[0] = 'fsdp2gen'; main()\n"
    )

    def fsdp2gen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", run_cli, *args], capture_output=True, text=True, timeout=120)

    for command in ("new", "update"):
        shown = fsdp2gen(command, "--help")
        assert shown.returncode == 0, shown.stderr
        assert "--wandb / --no-wandb" in shown.stdout and "Also log metrics to Weights & Biases" in shown.stdout
        assert "--optimizer <adamw|sgd>" in shown.stdout
    made = fsdp2gen("new", str(tmp_path / "run"), "--yes", "--dry-run", "--json", "--wandb", "--optimizer", "sgd")
    assert made.returncode == 0, made.stderr
    answers = json.loads(made.stdout)["answers"]
    assert answers["wandb"] is True and answers["optimizer"] == "sgd"
    refused = fsdp2gen("new", str(tmp_path / "run"), "--yes", "--optimizer", "adam")
    assert refused.returncode == 2 and "--optimizer" in refused.stderr, refused.stderr
