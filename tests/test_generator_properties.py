"""Property tests of the generator's bad-input contract on values nobody listed (issue 24).

Every option of `new` and `plan` (read from the typer app, so a new option is drawn too) gets arbitrary strings,
integers, floats (NaN, inf, huge, negative), unicode or nothing; and arbitrary YAML documents (anchors, aliases,
nesting, non-mappings, wrong types) are given as answers files to `new`, `new --force`, `plan` and `update`. The
contract: exit 0, or exit 2 with one line (on stderr; a JSON object on stdout under --json) and nothing written;
never a traceback. In-process (typer's CliRunner) to keep ~100 draws each under a minute.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import typer
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fsdp2gen.cli import app
from fsdp2gen.questions import questions

COMMAND = typer.main.get_command(app)
PROPERTY_SETTINGS = settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.integers(min_value=1, max_value=8).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "-1", "1e300", "1e-300", "nan", "inf", "-inf", "2**32", "4294967296", "", " ", "1_000"]),
)


def _value(option: typer.core.TyperOption) -> st.SearchStrategy[str]:
    question = questions().get(option.name or "")
    choices = question.choice_values if question else []
    return st.one_of(NUMBERS, TEXT, *([st.sampled_from(choices)] if choices else []))


def _argv(command: str) -> st.SearchStrategy[list[str]]:
    """A draw of up to 5 of `command`'s options, in any order (flags: either spelling; others: a value)."""
    options = []
    for option in COMMAND.commands[command].params:
        if not isinstance(option, typer.core.TyperOption):  # typer vendors click: not click.Option
            continue
        spellings = option.opts + option.secondary_opts
        options.append(
            st.sampled_from(spellings).map(lambda flag: [flag])
            if option.is_flag
            else st.tuples(st.sampled_from(option.opts), _value(option)).map(list)
        )
    chosen = st.lists(st.sampled_from(range(len(options))), max_size=5, unique=True)
    return chosen.flatmap(lambda picked: st.tuples(*[options[i] for i in picked])).map(
        lambda pairs: [arg for pair in pairs for arg in pair]
    )


def assert_contract(argv: list[str], folder: Path, before: set[str]) -> None:
    """Run the CLI in `folder`; exit 0, or exit 2 with one line and nothing new in `folder`; no traceback."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        result = CliRunner().invoke(app, argv, input="")
    finally:
        os.chdir(cwd)
    shown = f"{argv!r}: exit {result.exit_code}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (shown, result.exception)
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert result.exit_code in (0, 2), shown
    if result.exit_code == 2:
        if "--json" in argv and not result.stderr:
            assert result.stdout.count("\n") == 1 and json.loads(result.stdout)["code"] == 2, shown
        else:
            assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, shown
            assert result.stderr.startswith("fsdp2gen: error: ") and result.stderr.strip() != "fsdp2gen: error:", shown
        now = {str(p.relative_to(folder)) for p in folder.rglob("*")}
        assert now == before, (shown, now - before)


@PROPERTY_SETTINGS
@given(_argv("new"))
def test_new_with_any_option_values(options: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # DEST is fixed inside the scratch folder: a drawn DEST could name any folder of this machine.
        assert_contract(["new", "run", *options], Path(tmp), set())


@PROPERTY_SETTINGS
@given(_argv("plan"))
def test_plan_with_any_option_values(options: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        assert_contract(["plan", *options], Path(tmp), set())


# YAML documents: YAML's own types nested, keys among the questions' names and others, dumped as YAML; or text
# with anchors and aliases, or anything.
NAMES = st.one_of(st.sampled_from([*questions(), "_commit", "_src_path"]), TEXT)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(), TEXT,
    st.sampled_from(["llama", "hf", "bf16", "torchrun", "slurm", "dcp", "true", "4"]),
)  # fmt: skip
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3))
DUMPED = st.one_of(st.dictionaries(NAMES, VALUES, max_size=6), VALUES).map(
    lambda value: yaml.safe_dump(value, allow_unicode=True)
)
ANCHORED = st.lists(
    st.tuples(NAMES, st.sampled_from(["&a ", "*a ", "&b [*a, *a] ", "*b ", "<<: *a ", ""]), SCALARS), max_size=6
).map(lambda lines: "".join(f"{json.dumps(k)}: {mark}{json.dumps(v)}\n" for k, mark, v in lines))
DOCUMENTS = st.one_of(DUMPED, ANCHORED, TEXT)


@PROPERTY_SETTINGS
@given(DOCUMENTS, st.sampled_from(["new", "new --force", "plan", "update"]))
def test_any_answers_file(document: str, command: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if command == "new":
            (folder / "a.yml").write_text(document)
            argv = ["new", "run", "-y", "--dry-run", "--answers-file", "a.yml"]
        elif command == "new --force":
            (folder / "run").mkdir()
            (folder / "run" / ".copier-answers.yml").write_text(document)
            argv = ["new", "run", "-y", "--dry-run", "--force"]
        elif command == "plan":
            (folder / "config.toml").write_text("")
            (folder / ".copier-answers.yml").write_text(document)
            argv = ["plan", "--config", "config.toml"]
        else:  # not a git checkout: the answers file is read (and must be refused cleanly) before that check
            (folder / "p").mkdir()
            (folder / "p" / ".copier-answers.yml").write_text(document)
            argv = ["update", "p"]
        before = {str(p.relative_to(folder)) for p in folder.rglob("*")}
        assert_contract(argv, folder, before)
