"""A generated project's script run as `python SCRIPT ARGS` would run it, but in the test's own process: for a
one-process run (a reference, a preparation) that needs no process of its own, hence no import of torch (and
transformers: ~6 CPU-s) of its own."""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path

from tests.conftest import project_modules
from tests.helpers.scripts import run_in_this_process


def script_in_this_process(project: Path, script: str, *args: str) -> None:
    """Run `python SCRIPT ARGS` in `project` in this process (run_in_this_process); fail unless it exits 0."""
    try:
        run_in_this_process(project, script, *args)
    except SystemExit as exit:  # train.py ends with sys.exit(its exit code)
        assert exit.code in (None, 0), f"{script} exited {exit.code}"


def preflight_cases_in_this_process(project: Path, cases: dict[str, list[str]]) -> dict[str, list]:
    """{case: [exit code, stdout, stderr]} of `python preflight.py ARGS` in `project` for each case's ARGS, as
    conftest's preflight_cases gives them, but run in this process (tests/helpers/preflight_driver.py's run_case:
    preflight.main() with sys.argv set, its output captured): preflight involves nothing distributed, and torch is
    imported here already. What it changes is set back after: the project's modules, the folder, sys.argv, the
    collector (preflight.main freezes what the process holds)."""
    from tests.helpers.preflight_driver import run_case

    argv = sys.argv
    try:
        with project_modules(project), contextlib.chdir(project):
            return {case: run_case(args) for case, args in cases.items()}
    finally:
        sys.argv = argv
        gc.unfreeze()
        gc.enable()
