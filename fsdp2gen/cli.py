"""The `fsdp2gen` command line.

Options, choices, defaults and help for `new` come from the template's
copier.yml (see questions.py). Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import enum
import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from fsdp2gen import __version__
from fsdp2gen.questions import Question, load_answers_file, questions, validate
from fsdp2gen.render import DestinationError, check_destination, render_project

EXIT_BAD_INPUT = 2


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
            message = error.format_message() if hasattr(error, "format_message") else str(error)
            if "--json" in argv:
                typer.echo(json.dumps({"error": message, "code": EXIT_BAD_INPUT}))
            else:
                typer.echo(f"fsdp2gen: error: {message}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except typer.Abort:
            typer.echo("fsdp2gen: aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


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
Family = _choices_enum(QUESTIONS["family"])
Precision = _choices_enum(QUESTIONS["precision"])
Checkpoint = _choices_enum(QUESTIONS["checkpoint"])
Launcher = _choices_enum(QUESTIONS["launcher"])
ActivationCheckpointing = _choices_enum(QUESTIONS["activation_checkpointing"])

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


def _help(name: str) -> str:
    question = QUESTIONS[name]
    return f"{question.help} [default: {question.default}]"


FamilyOption = Annotated[Family | None, typer.Option(help=_help("family"))]
GpusOption = Annotated[int | None, typer.Option(help=_help("gpus"))]
NodesOption = Annotated[int | None, typer.Option(help=_help("nodes"))]
PrecisionOption = Annotated[Precision | None, typer.Option(help=_help("precision"))]
CheckpointOption = Annotated[Checkpoint | None, typer.Option(help=_help("checkpoint"))]
LauncherOption = Annotated[Launcher | None, typer.Option(help=_help("launcher"))]
TpOption = Annotated[int | None, typer.Option("--tp", help=_help("tp"))]
HfModelOption = Annotated[str | None, typer.Option(help=QUESTIONS["hf_model"].help, show_default=False)]
PretrainedOption = Annotated[
    bool | None, typer.Option("--pretrained/--from-scratch", help=_help("pretrained"), show_default=False)
]
ReshardOption = Annotated[str | None, typer.Option(help=_help("reshard_after_forward"), show_default=False)]
ActivationCheckpointingOption = Annotated[
    ActivationCheckpointing | None, typer.Option(help=_help("activation_checkpointing"))
]
CompileOption = Annotated[bool | None, typer.Option("--compile/--no-compile", help=_help("compile"))]
Float8Option = Annotated[bool | None, typer.Option("--float8/--no-float8", help=_help("float8"))]
CpuOffloadOption = Annotated[bool | None, typer.Option("--cpu-offload/--no-cpu-offload", help=_help("cpu_offload"))]
PrefetchOption = Annotated[bool | None, typer.Option("--prefetch/--no-prefetch", help=_help("prefetch"))]
TensorboardOption = Annotated[bool | None, typer.Option("--tensorboard/--no-tensorboard", help=_help("tensorboard"))]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object (the result, or the error).")]


def _given_answers(**options: Any) -> dict[str, Any]:
    """The answers given as options (enums as their values), each checked by the template's validator."""
    answers = {name: value.value if isinstance(value, enum.Enum) else value for name, value in options.items()}
    answers = {name: value for name, value in answers.items() if value is not None}
    for name, problem in validate(answers).items():
        fail(f"{QUESTIONS[name].flag}: {problem}")
    return answers


@app.command()
def new(
    dest: Annotated[
        Path,
        typer.Argument(metavar="DEST", help="Folder to create; its name becomes the project name.", show_default=False),
    ],
    family: FamilyOption = None,
    gpus: GpusOption = None,
    nodes: NodesOption = None,
    precision: PrecisionOption = None,
    bf16: Annotated[bool, typer.Option("--bf16", help="Same as --precision bf16.")] = False,
    fp16: Annotated[bool, typer.Option("--fp16", help="Same as --precision fp16.")] = False,
    fp32: Annotated[bool, typer.Option("--fp32", help="Same as --precision fp32.")] = False,
    checkpoint: CheckpointOption = None,
    launcher: LauncherOption = None,
    tp: TpOption = None,
    hf_model: HfModelOption = None,
    pretrained: PretrainedOption = None,
    reshard_after_forward: ReshardOption = None,
    activation_checkpointing: ActivationCheckpointingOption = None,
    compile_blocks: CompileOption = None,
    float8: Float8Option = None,
    cpu_offload: CpuOffloadOption = None,
    prefetch: PrefetchOption = None,
    tensorboard: TensorboardOption = None,
    project_name: Annotated[str | None, typer.Option(help="Project name [default: DEST's folder name]")] = None,
    answers_file: Annotated[
        Path | None,
        typer.Option(help="YAML file of answers (the keys of .copier-answers.yml); flags may not contradict it."),
    ] = None,
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
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List the files that would be written; write nothing.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Generate an FSDP2 training project in DEST."""
    shortcuts = [name for name, flag in (("bf16", bf16), ("fp16", fp16), ("fp32", fp32)) if flag]
    if len(shortcuts) > 1 or (shortcuts and precision and precision.value != shortcuts[0]):
        given = [f"--{s}" for s in shortcuts] + ([f"--precision {precision.value}"] if precision else [])
        fail(f"conflicting precision options {' '.join(given)}; give only one")
    if shortcuts:
        precision = Precision(shortcuts[0])

    answers = _given_answers(
        family=family,
        gpus=gpus,
        nodes=nodes,
        precision=precision,
        checkpoint=checkpoint,
        launcher=launcher,
        tp=tp,
        hf_model=hf_model,
        pretrained=pretrained,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        compile=compile_blocks,
        float8=float8,
        cpu_offload=cpu_offload,
        prefetch=prefetch,
        tensorboard=tensorboard,
    )
    if project_name is not None:
        answers.update(_given_answers(project_name=project_name))
    if answers_file is not None:
        answers = _merge_answers_file(answers_file, answers)
    try:
        check_destination(dest.absolute(), force=force)
    except DestinationError as error:
        fail(str(error))

    missing = [name for name in ASKED if name not in answers]
    if interactive is None:
        interactive = _stdin_is_terminal()
    if interactive and not yes and not as_json:
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
        if interactive and not yes and not as_json and question.error(question.default, answers):
            answers[name] = _ask(question, answers)
        else:
            answers[name] = question.default
            unasked.append(name)
    # Every answer, defaults included, against the template's validators (e.g. --family hf needs --hf-model).
    for name, problem in validate(answers).items():
        fail(f"{QUESTIONS[name].flag}: {problem}")
    if unasked and not yes and not as_json:
        used = ", ".join(f"{name}={answers[name]}" for name in unasked)
        typer.echo(
            f"fsdp2gen: stdin is not a terminal; using defaults {used} (pass --yes to accept silently)", err=True
        )

    try:
        written, answers = render_project(dest, answers, force=force, dry_run=dry_run)
    except (DestinationError, ValueError) as error:
        fail(str(error))
    commands = next_commands(dest, answers)
    if as_json:
        report = {
            "dest": str(dest.absolute()),
            "dry_run": dry_run,
            "answers": answers,
            "defaults_used": missing,
            "files": written,
            "next": [{"command": command, "why": why} for command, why in commands],
        }
        typer.echo(json.dumps(report, indent=2))
        return
    verb = "Would create" if dry_run else "Created"
    summary = ", ".join(f"{name}={value}" for name, value in answers.items())
    typer.echo(f"{verb} {dest} ({summary}) with {len(written)} files:")
    for path in written:
        typer.echo(f"  {path}")
    if not dry_run:
        typer.echo("\nNext:")
        for command, why in commands:
            typer.echo(f"  {command}" + (f"   # {why}" if why else ""))


def _merge_answers_file(path: Path, flag_answers: dict[str, Any]) -> dict[str, Any]:
    """Answers from `path` plus those given as flags; a flag that contradicts the file is an error."""
    try:
        from_file = load_answers_file(path)
    except ValueError as error:
        fail(str(error))
    for name, value in flag_answers.items():
        if name in from_file and from_file[name] != value:
            fail(f"--{name} {value} contradicts {name}: {from_file[name]} in {path}; drop one of them")
    return {**from_file, **flag_answers}


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # stdin was closed
        return False


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


def next_commands(dest: Path, answers: dict[str, Any]) -> list[tuple[str, str]]:
    """(command, why) pairs to run after generation, in order."""
    commands = [
        (f"cd {shlex.quote(str(dest))}", ""),
        ("pip install -e '.[test]'", ""),
        ("NPROC=2 DEVICE=cpu scripts/launch_local.sh --training.steps 20", "2 CPU processes, gloo"),
        ("scripts/launch_local.sh", f"{answers['gpus']} GPU(s) with nccl"),
    ]
    if answers["launcher"] == "slurm":
        commands.append(("sbatch scripts/slurm.sbatch", f"{answers['nodes']} node(s) on SLURM"))
    if answers["launcher"] == "ray":
        workers = answers["gpus"] * answers["nodes"]
        commands.append((f"python ray_train.py --workers {workers}", "on the Ray cluster in RAY_ADDRESS"))
    if answers["nodes"] > 1:
        commands.append(
            ("MASTER_ADDR=<node 0> MASTER_PORT=29500 NODE_RANK=<i> scripts/launch_multinode.sh", "on each node")
        )
    commands.append(("pytest", "the project's own tests"))
    return commands


class Conflict(enum.StrEnum):
    inline = "inline"
    rej = "rej"


@app.command()
def update(
    path: Annotated[Path, typer.Argument(help="The generated project (a clean git checkout).")] = Path("."),
    family: FamilyOption = None,
    gpus: GpusOption = None,
    nodes: NodesOption = None,
    precision: PrecisionOption = None,
    checkpoint: CheckpointOption = None,
    launcher: LauncherOption = None,
    tp: TpOption = None,
    hf_model: HfModelOption = None,
    pretrained: PretrainedOption = None,
    reshard_after_forward: ReshardOption = None,
    activation_checkpointing: ActivationCheckpointingOption = None,
    compile_blocks: CompileOption = None,
    float8: Float8Option = None,
    cpu_offload: CpuOffloadOption = None,
    prefetch: PrefetchOption = None,
    tensorboard: TensorboardOption = None,
    conflict: Annotated[
        Conflict, typer.Option(help="How to show conflicts: inline markers or .rej files, as copier does.")
    ] = Conflict.inline,
    vcs_ref: Annotated[
        str | None, typer.Option(help="Template version (git tag) to update to [default: newest]")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Update a generated project to a newer template version, keeping your edits (runs `copier update`)."""
    from fsdp2gen.update import UpdateError, update_project

    answers = _given_answers(
        family=family,
        gpus=gpus,
        nodes=nodes,
        precision=precision,
        checkpoint=checkpoint,
        launcher=launcher,
        tp=tp,
        hf_model=hf_model,
        pretrained=pretrained,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        compile=compile_blocks,
        float8=float8,
        cpu_offload=cpu_offload,
        prefetch=prefetch,
        tensorboard=tensorboard,
    )
    try:
        conflicts = update_project(path, answers, conflict=conflict.value, vcs_ref=vcs_ref)
    except UpdateError as error:
        fail(str(error))
    if as_json:
        typer.echo(json.dumps({"project": str(path.absolute()), "answers": answers, "conflicts": conflicts}, indent=2))
    elif conflicts:
        typer.echo(f"Updated {path} with conflicts to resolve in: {', '.join(conflicts)}")
    else:
        typer.echo(f"Updated {path}; review with `git diff` and commit")


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
        list[Path],
        typer.Argument(metavar="PATH...", help="Python files, or folders searched for *.py.", show_default=False),
    ],
    output_format: Annotated[str, typer.Option("--format", help="text (like ruff) or json.")] = "text",
) -> None:
    """Find FSDP2 mistakes in training scripts without running them; exit 1 when something is found."""
    # Imported here so that `fsdp2gen --help` and `new` do not pay for it.
    from fsdp2gen import check as checker

    if output_format not in ("text", "json"):
        fail(f"--format {output_format}: choose text or json")
    try:
        findings = checker.check_paths(paths)
    except checker.CheckInputError as error:
        fail(str(error))
    if output_format == "json":
        typer.echo(checker.format_json(findings))
    elif findings:
        typer.echo(checker.format_text(findings))
    raise typer.Exit(1 if findings else 0)


@app.command()
def plan(
    family: Annotated[Family | None, typer.Option(help="Model family. [default: llama]", show_default=False)] = None,
    size: Annotated[
        str | None, typer.Option(help="Llama 3 size preset: 1b, 3b, 8b, 70b or 405b.", show_default=False)
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="A generated project's config.toml (model and batch from it).", show_default=False),
    ] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs per node. [default: 8, or the project's]")] = None,
    nodes: Annotated[int | None, typer.Option(help="Number of nodes. [default: 1, or the project's]")] = None,
    precision: Annotated[
        Precision | None, typer.Option(help="Compute precision. [default: bf16, or the project's]")
    ] = None,
    offload: Annotated[bool, typer.Option("--offload", help="Keep parameters, gradients, optimizer on CPU.")] = False,
    ac: Annotated[str, typer.Option("--ac", help="Activation checkpointing: none, selective or full.")] = "none",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (FSDP over the rest).")] = 1,
    batch: Annotated[
        int | None, typer.Option(help="Micro-batch per GPU. [default: 1, or from global_batch_size]")
    ] = None,
    seq: Annotated[int | None, typer.Option(help="Sequence length. [default: 8192, or the project's]")] = None,
    gpu: Annotated[str, typer.Option(help="GPU model, e.g. h100-80gb, a100-40gb, h200-141gb.")] = "h100-80gb",
    grad_sync: Annotated[
        str | None,
        typer.Option(
            help="Gradient accumulation: every_micro_batch (reduce-scatter each micro-batch, sharded gradients) or "
            "last_micro_batch (the whole model's unsharded gradients on every GPU). [default: every_micro_batch, "
            "or the project's training.grad_sync]",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Per-GPU memory of FSDP2 training (state, buffers, activations) and whether it fits."""
    from fsdp2gen import plan as planner

    try:
        request = planner.build_request(
            family=family.value if family else None,
            size=size,
            config=config,
            gpus=gpus,
            nodes=nodes,
            precision=precision.value if precision else None,
            offload=offload,
            ac=ac,
            tp=tp,
            batch=batch,
            seq=seq,
            gpu=gpu,
            grad_sync=grad_sync,
        )
    except planner.PlanError as error:
        fail(str(error))
    result = planner.estimate(request)
    typer.echo(planner.format_json(result) if as_json else planner.format_text(result))


def main() -> None:
    app()
