"""The `fsdp2gen` command line.

Options, choices, defaults and help for `new` come from the template's
copier.yml (see questions.py). Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import enum
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from fsdp2gen import __version__
from fsdp2gen.questions import Question, questions, validate
from fsdp2gen.render import DestinationError, check_destination, render_project

EXIT_BAD_INPUT = 2


class OneLineErrors(TyperGroup):
    """Report usage errors as `fsdp2gen: error: ...` on one line (exit 2), for people and agents alike."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as error:
            # Usage errors (bad option value, missing argument); typer >= 0.29 vendors click.
            fail(error.format_message() if hasattr(error, "format_message") else str(error))
        except typer.Abort:
            typer.echo("fsdp2gen: aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


def fail(message: str) -> None:
    typer.echo(f"fsdp2gen: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _choices_enum(question: Question) -> type[enum.StrEnum]:
    """A str Enum of the question's choices, so the CLI grows with the template."""
    return enum.StrEnum(question.name.capitalize(), {value: value for value in question.choice_values})


QUESTIONS = questions()
Family = _choices_enum(QUESTIONS["family"])
Precision = _choices_enum(QUESTIONS["precision"])
Checkpoint = _choices_enum(QUESTIONS["checkpoint"])

app = typer.Typer(
    cls=OneLineErrors,
    help="Scaffold a PyTorch FSDP2 (fully_shard) training project that trains correctly from the first run.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"fsdp2gen {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


def _help(name: str) -> str:
    question = QUESTIONS[name]
    return f"{question.help} [default: {question.default}]"


@app.command()
def new(
    dest: Annotated[
        Path,
        typer.Argument(metavar="DEST", help="Folder to create; its name becomes the project name.", show_default=False),
    ],
    family: Annotated[Family | None, typer.Option(help=_help("family"))] = None,
    gpus: Annotated[int | None, typer.Option(help=_help("gpus"))] = None,
    nodes: Annotated[int | None, typer.Option(help=_help("nodes"))] = None,
    precision: Annotated[Precision | None, typer.Option(help=_help("precision"))] = None,
    bf16: Annotated[bool, typer.Option("--bf16", help="Same as --precision bf16.")] = False,
    fp16: Annotated[bool, typer.Option("--fp16", help="Same as --precision fp16.")] = False,
    fp32: Annotated[bool, typer.Option("--fp32", help="Same as --precision fp32.")] = False,
    checkpoint: Annotated[Checkpoint | None, typer.Option(help=_help("checkpoint"))] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Use defaults for every answer not given.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Allow writing into a non-empty DEST.")] = False,
    interactive: Annotated[
        bool | None,
        typer.Option(
            "--interactive/--no-interactive",
            help="Ask for missing answers (default: ask only when stdin is a terminal).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Generate an FSDP2 training project in DEST."""
    shortcuts = [name for name, flag in (("bf16", bf16), ("fp16", fp16), ("fp32", fp32)) if flag]
    if len(shortcuts) > 1 or (shortcuts and precision and precision.value != shortcuts[0]):
        given = [f"--{s}" for s in shortcuts] + ([f"--precision {precision.value}"] if precision else [])
        fail(f"conflicting precision options {' '.join(given)}; give only one")
    if shortcuts:
        precision = Precision(shortcuts[0])

    given = {"family": family, "gpus": gpus, "nodes": nodes, "precision": precision, "checkpoint": checkpoint}
    answers = {name: value.value if isinstance(value, enum.Enum) else value for name, value in given.items()}
    answers = {name: value for name, value in answers.items() if value is not None}
    for name, problem in validate(answers).items():
        fail(f"--{name}: {problem}")
    try:
        check_destination(dest.absolute(), force=force)
    except DestinationError as error:
        fail(str(error))

    missing = [name for name in QUESTIONS if name not in answers]
    if interactive is None:
        interactive = sys.stdin.isatty()
    if missing and not yes and interactive:
        for name in missing:
            answers[name] = _ask(QUESTIONS[name], answers)
    elif missing:
        for name in missing:
            answers[name] = QUESTIONS[name].default
        if not yes:
            used = ", ".join(f"{name}={answers[name]}" for name in missing)
            typer.echo(
                f"fsdp2gen: stdin is not a terminal; using defaults {used} (pass --yes to accept silently)", err=True
            )

    answers = {name: answers[name] for name in QUESTIONS}
    try:
        written = render_project(dest, answers, force=force)
    except (DestinationError, ValueError) as error:
        fail(str(error))
    _report(dest, answers, written)


def _ask(question: Question, answers: dict[str, Any]) -> Any:
    """Prompt until the answer passes the template's own checks and validator."""
    text = question.help
    if question.choices:
        text += f" ({', '.join(question.choice_values)})"
    while True:
        raw = typer.prompt(text, default=str(question.default))
        try:
            value = question.convert(raw.strip())
        except ValueError:
            typer.echo(f"Error: {raw!r} is not a valid {question.type}", err=True)
            continue
        problem = question.error(value, answers)
        if problem is None:
            return value
        typer.echo(f"Error: {problem}", err=True)


def _report(dest: Path, answers: dict[str, Any], written: list[str]) -> None:
    summary = ", ".join(f"{name}={value}" for name, value in answers.items())
    typer.echo(f"Created {dest} ({summary}) with {len(written)} files:")
    for path in written:
        typer.echo(f"  {path}")
    typer.echo("\nNext:")
    typer.echo(f"  cd {shlex.quote(str(dest))}")
    typer.echo("  pip install -e '.[test]'")
    typer.echo("  NPROC=2 DEVICE=cpu scripts/run_local.sh --training.steps 20   # 2 CPU processes, gloo")
    typer.echo(f"  scripts/run_local.sh   # {answers['gpus']} GPU(s) with nccl")
    if answers["nodes"] > 1:
        typer.echo("  MASTER_ADDR=<node 0> MASTER_PORT=29500 NODE_RANK=<i> scripts/run_multinode.sh   # on each node")
    typer.echo("  pytest   # the project's own tests")


def main() -> None:
    app()
