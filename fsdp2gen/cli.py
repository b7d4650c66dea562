"""The `fsdp2gen` command line.

The answer options of `new` and `update`, and those `plan` shares with them (flags,
choices, defaults, help), are generated from the template's copier.yml (see
questions.py, _option and answer_options), so a new question needs no change here.
Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import enum
import inspect
import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperGroup

from fsdp2gen import __version__
from fsdp2gen import questions as q
from fsdp2gen.questions import Question, load_answers_file, project_name_from_folder, questions
from fsdp2gen.render import ANSWERS_FILE, DestinationError, check_destination, is_project, render_project
from fsdp2gen.report import new_report, update_report
from fsdp2gen.sizes import sizes
from fsdp2gen.update import UpdateError, recorded_answers, rerender, update_project

EXIT_BAD_INPUT = 2
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


class BadInput(Exception):
    """Input the user can fix; reported as one line (or a JSON object) with exit code 2."""


def fail(message: str) -> NoReturn:
    raise BadInput(message)


class OneLineErrors(TyperGroup):
    """Report bad input as `fsdp2gen: error: ...` on one line, or as JSON under --json, with exit code 2."""

    def main(self, args: list[str] | None = None, *rest: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            result = super().main(argv, *rest, standalone_mode=False, **kwargs)
        except (BadInput, typer.TyperException) as error:
            # TyperException covers usage errors: bad option value, missing argument (typer vendors click).
            message = _one_line(error)
            if "--json" in argv:
                typer.echo(json.dumps({"error": message, "code": EXIT_BAD_INPUT}))
            else:
                typer.echo(f"fsdp2gen: error: {message}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except typer.Abort:  # Ctrl-C (or Ctrl-D) at a prompt: the user stopped it, not bad input
            typer.echo("fsdp2gen: aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


def _one_line(error: Exception) -> str:
    """The error's message on one line, naming the value given when typer's own check refused it."""
    cause = error.__cause__
    if isinstance(error, typer.BadParameter) and hasattr(cause, "errors") and cause.errors():
        # typer checks option types with pydantic, whose message may not name the value and may start with
        # "Value error, " (pydantic's wording, not ours).
        first = cause.errors()[0]
        detail = str(first["msg"]).removeprefix("Value error, ")
        given = repr(first.get("input"))
        given = given if len(given) <= 60 else given[:57] + "..."
        error.message = detail if given in detail else f"{given}: {detail}"
    message = error.format_message() if hasattr(error, "format_message") else str(error)
    # One line whatever the source: click's messages can hold a newline, a template's validator too.
    return " ".join(message.split())


def _choices_enum(question: Question) -> type[enum.StrEnum]:
    """A str Enum of the question's choices, so the CLI grows with the template."""
    return enum.StrEnum(question.name.capitalize(), {value: value for value in question.choice_values})


QUESTIONS = questions()
# Answered by `new` (prompted for when missing on a terminal); project_name is not asked: copier derives
# it from DEST's folder name.
ASKED = [name for name in QUESTIONS if name != "project_name" and not QUESTIONS[name].when]
# The rest are performance options whose defaults suit most runs: never prompted for, only flags.
PROMPTED = ["family", "gpus", "nodes", "precision", "checkpoint", "launcher"]
# Questions for one family (copier's `when:`): they take their default, or are prompted for when a terminal
# is there and the default is not a valid answer (hf_model).
FAMILY_QUESTIONS = [name for name in QUESTIONS if QUESTIONS[name].when]

app = typer.Typer(
    cls=OneLineErrors,
    help="Scaffold a PyTorch FSDP2 (fully_shard) training project that trains correctly from the first run.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
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


# A bool question's flags are --name/--no-name, except where the "no" reads better as another word.
OFF_FLAGS = {"pretrained": "--from-scratch"}


def _option(question: Question, shown_default: Any = None) -> inspect.Parameter:
    """The question as a typer option: its type (choices as an Enum), help and default from copier.yml
    (`shown_default`: what the help gives as the default instead). Its value is None when not given, so
    that the answers file, recorded answers or default decide."""
    value_type: Any = (
        _choices_enum(question) if question.choices else {"int": int, "bool": bool}.get(question.type, str)
    )
    flag = question.flag
    if question.type == "bool":
        flag += "/" + OFF_FLAGS.get(question.name, "--no-" + question.flag.removeprefix("--"))
    shown = question.default if shown_default is None else shown_default
    help_text = question.help + (f" [default: {shown}]" if shown != "" else "")
    option = typer.Option(flag, help=help_text, show_default=False)
    return inspect.Parameter(question.name, KEYWORD_ONLY, default=None, annotation=Annotated[value_type | None, option])


def _shortcut(value: str) -> inspect.Parameter:
    """--VALUE for one of precision's choices: the same as --precision VALUE."""
    option = typer.Option(f"--{value}", help=f"Same as {QUESTIONS['precision'].flag} {value}.")
    return inspect.Parameter(value, KEYWORD_ONLY, default=False, annotation=Annotated[bool, option])


# One option per question but project_name (`update` keeps the recorded one), in the order `new` asks them:
# the prompted ones first, then the rest in copier.yml's order. `new` adds --bf16, --fp16 and --fp32 (one per
# precision choice) after --precision, and --project-name (its default is DEST's folder name).
ANSWER_OPTIONS = [
    _option(QUESTIONS[name])
    for name in PROMPTED + [name for name in QUESTIONS if name not in PROMPTED]
    if name != "project_name"
]
# --bf16, --fp16, --fp32: in alphabetical order, in the help and in the message that refuses two of them.
PRECISION_SHORTCUTS = sorted(QUESTIONS["precision"].choice_values)
_AFTER_PRECISION = [option.name for option in ANSWER_OPTIONS].index("precision") + 1
NEW_OPTIONS = [
    *ANSWER_OPTIONS[:_AFTER_PRECISION],
    *[_shortcut(value) for value in PRECISION_SHORTCUTS],
    *ANSWER_OPTIONS[_AFTER_PRECISION:],
    _option(QUESTIONS["project_name"], shown_default="DEST's folder name"),
]
Command = TypeVar("Command", bound=Callable[..., Any])


def answer_options(
    options: list[inspect.Parameter], after: dict[str, tuple[str, ...]] | None = None
) -> Callable[[Command], Command]:
    """Give the command `options` (generated from the questions), passed to its `**` parameter (None if not
    given).

    typer reads a command's parameters from its signature, so the decorated command's signature is rewritten:
    its arguments, the options, then its own (keyword-only) options; those named in `after` are listed right
    after that option instead.
    """

    def decorate(command: Command) -> Command:
        declared = inspect.signature(command, eval_str=True).parameters.values()
        own = {p.name: p for p in declared if p.kind is KEYWORD_ONLY}
        listed = [p for p in declared if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        for option in options:
            listed += [option] + [own.pop(name) for name in (after or {}).get(option.name, ())]
        command.__signature__ = inspect.Signature(listed + list(own.values()))  # type: ignore[attr-defined]
        return command

    return decorate


JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object (the result, or the error).")]


def _given_answers(options: dict[str, Any]) -> dict[str, Any]:
    """The answers given as options (enums as their values). They are checked once merged with the
    answers file, the project's recorded answers or the defaults: how they fit depends on those."""
    answers = {name: value.value if isinstance(value, enum.Enum) else value for name, value in options.items()}
    return {name: value for name, value in answers.items() if value is not None}


def _check_answers(answers: dict[str, Any], sources: dict[str, str]) -> None:
    """Fail on the first invalid answer, naming where it came from: a flag, or `name in FILE`."""
    if problem := q.first_problem(answers, sources):
        fail(problem)


def _complete_answers(answers: dict[str, Any], *, prompting: bool) -> list[str]:
    """Fill in every missing answer, prompting for the PROMPTED ones when `prompting`; return the names
    that took their default without being asked (announced when stdin is not a terminal)."""
    missing = [name for name in ASKED if name not in answers]
    if prompting:
        for name in [name for name in missing if name in PROMPTED]:
            answers[name] = _ask(QUESTIONS[name], answers)
            missing.remove(name)
    unasked = [name for name in missing if name in PROMPTED]
    for name in missing:
        answers[name] = QUESTIONS[name].default
    for name in FAMILY_QUESTIONS:
        question = QUESTIONS[name]
        if name in answers or not question.applies(answers):
            continue
        if prompting and question.error(question.default, answers):
            answers[name] = _ask(question, answers)
        else:
            answers[name] = question.default
            if question.default != "":  # an optional path left empty (llama's hf_model) chooses nothing to announce
                unasked.append(name)
    return unasked


@app.command()
@answer_options(NEW_OPTIONS)
def new(
    dest: Annotated[
        str,  # not Path: Path("") is ".", and an empty DEST must be refused, not read as the current folder
        typer.Argument(metavar="DEST", help="Folder to create; its name becomes the project name.", show_default=False),
    ],
    *,
    answers_file: Annotated[
        Path | None,
        typer.Option(help="YAML file of answers (the keys of .copier-answers.yml); flags may not contradict it."),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Use defaults for every answer not given.")] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Re-render the fsdp2gen project in DEST with these answers: files you edited are kept or merged "
            "(conflicts shown inline), files no longer generated are removed only if unedited; each file is listed.",
        ),
    ] = False,
    interactive: Annotated[
        bool | None,
        typer.Option(
            "--interactive/--no-interactive",
            help="Ask for missing answers (default: ask only when stdin is a terminal).",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List the files that would be written; write nothing.")
    ] = False,
    as_json: JsonOption = False,
    **flags: Any,
) -> None:
    """Generate an FSDP2 training project in DEST."""
    _apply_precision_shortcut(flags)
    answers = _given_answers(flags)
    dest_path, answers, defaults_used = _collect_answers(
        dest, answers, answers_file=answers_file, yes=yes, force=force, interactive=interactive, as_json=as_json
    )
    written, answers, changes = _write_project(dest_path, answers, force=force, dry_run=dry_run)
    typer.echo(new_report(dest_path, answers, written, changes, defaults_used=defaults_used, dry_run=dry_run,
                          as_json=as_json))  # fmt: skip


def _apply_precision_shortcut(flags: dict[str, Any]) -> None:
    """Take --bf16/--fp16/--fp32 out of the flags and set the precision answer from them (in place, keeping
    its place among the answers), refusing two shortcuts, or a shortcut that contradicts --precision."""
    shortcuts = [value for value in PRECISION_SHORTCUTS if flags.pop(value)]
    precision = flags["precision"]
    if len(shortcuts) > 1 or (shortcuts and precision and precision.value != shortcuts[0]):
        used = [f"--{s}" for s in shortcuts] + ([f"--precision {precision.value}"] if precision else [])
        fail(f"conflicting precision options {' '.join(used)}; give only one")
    if shortcuts:
        flags["precision"] = shortcuts[0]


def _collect_answers(
    dest: str, answers: dict[str, Any], *, answers_file: Path | None, yes: bool, force: bool,
    interactive: bool | None, as_json: bool,
) -> tuple[Path, dict[str, Any], list[str]]:  # fmt: skip
    """Every answer, checked, from the flags, then the answers file, then (with --force over a project) its
    recorded answers, then prompts (on a terminal) or the defaults; and DEST, checked before any prompt. Returns
    DEST, the answers and the asked questions that took their default (JSON's defaults_used)."""
    sources = {name: QUESTIONS[name].flag for name in answers}
    if answers_file is not None:
        answers = _merge_answers_file(answers_file, answers)
        sources.update({name: f"{name} in {answers_file}" for name in answers if name not in sources})
    answers = q.with_implied(answers)  # before the recorded answers: `new --force --qlora` over a --lora project
    if not dest.strip():
        fail("DEST is empty; give the folder to create, e.g. fsdp2gen new my-run")
    dest_path = Path(dest)
    if force and is_project(dest_path):  # a re-render keeps every recorded answer it is not given
        project = Path(os.path.abspath(dest_path))
        try:
            recorded = recorded_answers(project, f"restore it (git log -- {ANSWERS_FILE}) or choose another DEST")
        except UpdateError as error:
            fail(str(error))
        answers = q.with_recorded(recorded, answers)
        sources.update({name: f"{name} in {project / ANSWERS_FILE}" for name in answers if name not in sources})
    missing = [name for name in ASKED if name not in answers]
    if interactive is None:
        interactive = _stdin_is_terminal()
    prompting = interactive and not yes and not as_json
    if prompting and _stdin_is_closed():
        fail("--interactive needs stdin to read answers from, but stdin is closed; give the answers as flags "
             "or --answers-file, or pass --yes to use the defaults")  # fmt: skip
    # Without prompts the answers are final now: check them before the destination, as the user wrote them.
    unasked = [] if prompting else _complete_answers(answers, prompting=False)
    if not prompting:
        _check_answers(answers, sources)
    _check_dest(dest_path, answers, force=force)
    if prompting:
        unasked = _complete_answers(answers, prompting=True)
        _check_answers(answers, sources)
    if unasked and not yes and not as_json:
        used = ", ".join(f"{name}={answers[name]}" for name in unasked)
        typer.echo(
            f"fsdp2gen: stdin is not a terminal; using defaults {used} (pass --yes to accept silently)", err=True
        )
    return dest_path, answers, missing


def _check_dest(dest: Path, answers: dict[str, Any], *, force: bool) -> None:
    """DEST can be written to, and its folder name makes a valid project name unless one was given."""
    try:
        check_destination(dest, force=force)
    except DestinationError as error:
        fail(str(error))
    if "project_name" not in answers:
        # copier derives it from DEST's folder name: check it here, where the message can say so.
        derived = project_name_from_folder(Path(os.path.abspath(dest)).name)
        if problem := QUESTIONS["project_name"].error(derived, answers):
            fail(f"project name {derived!r} (from DEST's folder name): {problem}")


def _write_project(
    dest: Path, answers: dict[str, Any], *, force: bool, dry_run: bool
) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """Render the project (or list its files, on a dry run); returns its files, the recorded answers and,
    under --force over an existing project (re-rendered like `update`), what was done to each file."""
    try:
        if force and is_project(dest) and dest.is_dir():
            result = rerender(dest, answers, dry_run=dry_run)
            return result.files, result.answers, result.changes
        return (*render_project(dest, answers, dry_run=dry_run), {})
    except (DestinationError, ValueError) as error:
        fail(str(error))


def _merge_answers_file(path: Path, flag_answers: dict[str, Any]) -> dict[str, Any]:
    """Answers from `path` plus those given as flags; a flag that contradicts the file is an error."""
    try:
        from_file = load_answers_file(path)
    except ValueError as error:
        fail(str(error))
    for name, value in flag_answers.items():
        if name in from_file and from_file[name] != value:
            fail(f"{QUESTIONS[name].flag} {value} contradicts {name}: {from_file[name]} in {path}; drop one of them")
    return {**from_file, **flag_answers}


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # stdin was closed
        return False


def _stdin_is_closed() -> bool:
    """No stdin at all (`<&-`): Python sets sys.stdin to None, or it was closed since."""
    return sys.stdin is None or sys.stdin.closed


def _ask(question: Question, answers: dict[str, Any]) -> Any:
    """Prompt until the answer passes the template's own checks and validator. Answers read from a pipe get
    no second chance: a retry would take the next line, meant for the next question, as this answer."""
    text = question.help
    if question.choices:
        text += f" ({', '.join(question.choice_values)})"
    terminal = _stdin_is_terminal()
    while True:
        try:
            raw = typer.prompt(text, default=str(question.default))
        except typer.Abort:
            if terminal:
                raise  # the user pressed Ctrl-C or Ctrl-D
            fail(f"stdin ended before {question.flag} was answered; give it as {question.flag} VALUE, or pass "
                 "--yes to use the defaults")  # fmt: skip
        try:
            value = question.convert(raw.strip())
            problem = question.error(value, answers)
        except ValueError:
            problem = f"{raw!r} is not a valid {question.type}"
        if problem is None:
            return value
        if not terminal:
            fail(f"{question.flag}: {problem} (answer read from stdin)")
        typer.echo(f"Error: {problem}", err=True)


@app.command()
@answer_options(ANSWER_OPTIONS)
def update(
    path: Annotated[str, typer.Argument(help="The generated project (a clean git checkout).")] = ".",
    *,
    as_json: JsonOption = False,
    **flags: Any,
) -> None:
    """Bring a generated project to this fsdp2gen's template, with its recorded answers and any given: your edits
    are kept or merged (conflicts inline), offline."""
    if not path.strip():
        fail("PATH is empty; give the generated project's folder, e.g. fsdp2gen update .")
    project = Path(path)
    given = q.with_implied(_given_answers(flags))
    try:
        result = update_project(project, given)
    except (UpdateError, DestinationError) as error:
        fail(str(error))
    typer.echo(update_report(project, given, result, as_json=as_json))


@app.command("questions")
def list_questions(
    as_json: Annotated[bool, typer.Option("--json", help="Print the questions as a JSON list.")] = False,
) -> None:
    """The questions `new` asks, with their types, choices, defaults and help."""
    described = [question.describe() for question in QUESTIONS.values()]
    if as_json:
        typer.echo(json.dumps(described, indent=2))
        return
    for item in described:
        choices = f" ({', '.join(item['choices'])})" if item["choices"] else ""
        typer.echo(f"--{item['name']} {item['type'].upper()}{choices} [default: {item['default']}]\n    {item['help']}")


@app.command()
def check(
    paths: Annotated[
        list[str],  # not Path: Path("") is ".", which would check the current folder
        typer.Argument(metavar="PATH...", help="Python files, or folders searched for *.py.", show_default=False),
    ],
    output_format: Annotated[str, typer.Option("--format", help="text (like ruff) or json.")] = "text",
) -> None:
    """Find FSDP2 mistakes in training scripts without running them; exit 1 when something is found."""
    # Imported here so that `fsdp2gen --help` and `new` do not pay for it.
    from fsdp2gen import check as checker

    if output_format not in ("text", "json"):
        fail(f"--format {output_format}: choose text or json")
    if any(not path.strip() for path in paths):
        fail("an empty PATH was given; pass Python files or folders")
    findings = []
    for file in _checkable_files([Path(path) for path in paths]):
        try:
            findings += checker.check_paths([file])
        except checker.CheckInputError as error:
            fail(str(error))
        except RecursionError:
            fail(f"{file}: nested too deeply to analyse (Python's recursion limit); split the long expression "
                 "or exclude the file")  # fmt: skip
        except (ValueError, MemoryError) as error:  # e.g. NUL bytes in the source (a ValueError before 3.12)
            fail(f"{file}: cannot be parsed ({' '.join(str(error).split())}); fix the file or exclude it")
    if output_format == "json":
        typer.echo(checker.format_json(findings))
    elif findings:
        typer.echo(checker.format_text(findings))
    raise typer.Exit(1 if findings else 0)


def _checkable_files(paths: list[Path]) -> list[Path]:
    """The files `check` reads: only regular files. Reading a FIFO blocks until someone writes to it, and
    a device may never end; a folder whose name ends in .py is not a Python file."""
    from fsdp2gen import check as checker

    try:
        found = checker.python_files(paths)
    except checker.CheckInputError as error:
        fail(str(error))
    files = []
    for path in found:
        try:
            mode = path.stat().st_mode
        except OSError as error:
            fail(f"{path}: cannot read ({error.strerror}); fix the file or exclude it")
        if stat.S_ISREG(mode):
            files.append(path)
        elif not stat.S_ISDIR(mode):  # a given folder was searched; one found by the search is skipped
            fail(f"{path}: not a regular file (a pipe, a device or a socket); pass Python files or folders")
    return files


# The options `plan` shares with `new` (a project's answers): the question's flag, choices, type and help; under
# --config the project's config.toml (or its recorded answer) is the default, and a flag given overrides it.
PLAN_ANSWERS = ["gpus", "nodes", "precision", "tp"]
PLAN_OPTIONS = [
    _option(QUESTIONS[name], shown_default=f"{QUESTIONS[name].default}, or the project's") for name in PLAN_ANSWERS
] + [
    _option(QUESTIONS[name], shown_default=f"{QUESTIONS[name].default}, or the project's parallel.{name}")
    for name in ("activation_checkpointing", "cpu_offload")
]


def _size_names() -> str:
    """`plan --size`'s names (model.size's and larger published shapes, the mixture-of-experts ones last): 'a, b or
    c'."""
    *names, last = sizes()
    return f"{', '.join(names)} or {last}"


# `plan`'s options with long help, named here so that plan's signature stays one line an option.
HfConfigOption = Annotated[
    Path | None,
    typer.Option(
        help="A Hugging Face model's config.json, or its folder (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral), "
        "without a project.",
        show_default=False,
    ),
]
GradSyncOption = Annotated[
    str | None,
    typer.Option(
        help="Gradient accumulation: every_micro_batch (reduce-scatter each micro-batch, sharded gradients) or "
        "last_micro_batch (the whole model's unsharded gradients on every GPU). [default: every_micro_batch, "
        "or the project's training.grad_sync]",
        show_default=False,
    ),
]
CpOption = Annotated[
    int | None,
    typer.Option(
        help="Context parallelism (llama, hf): each of cp GPUs holds seq / cp tokens of every sample (ring "
        "attention); parameters are sharded over dp_shard x cp. [default: 1, or the project's parallel.cp]",
        show_default=False,
    ),
]
EpOption = Annotated[
    int | None,
    typer.Option(
        help="Expert parallelism (mixture-of-experts sizes): each GPU holds n_experts / ep experts, ep ranks borrowed "
        "from dp_shard; tokens go to their experts' GPUs by all-to-all. [default: 1, or the project's parallel.ep]",
        show_default=False,
    ),
]
PpOption = Annotated[
    int | None,
    typer.Option(
        help="Pipeline parallelism (llama, hf): the blocks split over pp GPUs of pp x V stages, FSDP (and TP) inside "
        "each stage; the plan is the worst stage's. [default: 1, or the project's parallel.pp]",
        show_default=False,
    ),
]
PpScheduleOption = Annotated[
    str | None,
    typer.Option(
        help="Pipeline schedule: 1F1B, GPipe, Interleaved1F1B, or zero bubble: InterleavedZeroBubble, ZBVZeroBubble, "
        "DualPipeV. [default: 1F1B, or the project's parallel.pp_schedule]",
        show_default=False,
    ),
]
PpStagesOption = Annotated[
    int | None,
    typer.Option(
        help="Stages per pipeline rank (V): 1, 2 or more for the interleaved schedules, 2 for ZBVZeroBubble and "
        "DualPipeV. [default: 1 (the multi-stage schedules: 2), "
        "or the project's parallel.pp_stages_per_rank]",
        show_default=False,
    ),
]
GradAccumOption = Annotated[
    int | None,
    typer.Option(
        help="Micro-batches per step (under --pp: the schedule's micro-batches). [default: the project's "
        "training.grad_accum_steps; with --size and --pp: pp x V]",
        show_default=False,
    ),
]
DpReplicateOption = Annotated[
    int | None,
    typer.Option(
        help="HSDP: this many copies of the model, each sharded over the GPUs / dp_replicate (/ tp ...); the state "
        "per GPU is that of one copy's shard. [default: 1, or the project's parallel.dp_replicate]",
        show_default=False,
    ),
]
LossChunksOption = Annotated[
    int | None,
    typer.Option(
        help="The loss's logits are computed this many sequence chunks at a time (chunked_loss.py). [default: "
        "8, or the project's training.loss_chunks]",
        show_default=False,
    ),
]
CpSweepOption = Annotated[
    bool,
    typer.Option(
        "--cp-sweep",
        help="Instead of one plan, a table of activations and total per GPU for seq 32768 to 262144 with cp 1, "
        "2, 4 and 8 (those the GPUs allow): when a long sequence needs context parallelism.",
    ),
]


SizeOption = Annotated[
    str | None,
    typer.Option(
        help=f"{_size_names()}: model.size's presets and larger Llama 3 shapes, then the mixture-of-experts presets.",
        show_default=False,
    ),
]
ConfigOption = Annotated[
    Path | None, typer.Option(help="A generated project's config.toml (model and batch from it).", show_default=False)
]
BatchOption = Annotated[int | None, typer.Option(help="Micro-batch per GPU. [default: 1, or from global_batch_size]")]
SeqOption = Annotated[
    int | None, typer.Option(help="Sequence length. [default: the size's max_seq_len, or the project's]")
]
GpuTypeOption = Annotated[str, typer.Option(help="GPU model, e.g. h100-80gb, a100-40gb, h200-141gb.")]

LoraOption = Annotated[
    bool,
    typer.Option(
        "--lora",
        help="With --hf-config: LoRA fine-tuning as `new --lora` builds it (only the adapters train; the template's "
        "[lora] table: its 7 linear layers, a mixture-of-experts model's 4 attention layers). --config plans a "
        "project's own [lora].",
    ),
]
LoraRankOption = Annotated[
    int | None, typer.Option(help="With --lora or --qlora: the adapters' rank. [default: 16]", show_default=False)
]
QloraOption = Annotated[
    bool,
    typer.Option("--qlora", help="With --hf-config: --lora on an NF4 base (the adapted layers' frozen weights)."),
]


@app.command()
@answer_options(PLAN_OPTIONS)
def plan(
    *,
    size: SizeOption = None,
    config: ConfigOption = None,
    hf_config: HfConfigOption = None,
    batch: BatchOption = None,
    seq: SeqOption = None,
    gpu_type: GpuTypeOption = "h100-80gb",
    grad_sync: GradSyncOption = None,
    cp: CpOption = None,
    cp_sweep: CpSweepOption = False,
    ep: EpOption = None,
    pp: PpOption = None,
    pp_schedule: PpScheduleOption = None,
    pp_stages_per_rank: PpStagesOption = None,
    grad_accum_steps: GradAccumOption = None,
    dp_replicate: DpReplicateOption = None,
    loss_chunks: LossChunksOption = None,
    lora: LoraOption = False,
    lora_rank: LoraRankOption = None,
    qlora: QloraOption = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    **answers: Any,
) -> None:
    """Per-GPU memory of FSDP2 training (state, buffers, activations) and whether it fits."""
    from fsdp2gen import plan as planner

    try:
        if cp_sweep and (seq is not None or cp is not None):
            raise planner.PlanError(
                f"--cp-sweep plans seq 32768 to 262144 with cp 1 to 8 itself; drop {'--seq' if seq else '--cp'}"
            )
        request = planner.build_request(
            size=size, config=config, hf_config=hf_config, batch=batch, seq=seq, gpu_type=gpu_type, grad_sync=grad_sync,
            cp=cp, ep=ep, pp=pp, pp_schedule=pp_schedule, pp_stages_per_rank=pp_stages_per_rank,
            grad_accum_steps=grad_accum_steps, dp_replicate=dp_replicate, loss_chunks=loss_chunks, lora=lora,
            lora_rank=lora_rank, qlora=qlora, **_given_answers(answers),
        )  # fmt: skip
        if cp_sweep:
            plans = planner.cp_sweep(request)
    except planner.PlanError as error:
        fail(str(error))
    if cp_sweep:
        typer.echo(planner.format_cp_sweep_json(plans) if as_json else planner.format_cp_sweep(plans))
        return
    result = planner.estimate(request)
    typer.echo(planner.format_json(result) if as_json else planner.format_text(result))


def main() -> None:
    app()
