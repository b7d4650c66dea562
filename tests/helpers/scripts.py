"""Scripts of a generated project run one after the other in ONE Python process (runpy), as `python SCRIPT ARGS`
would run each: torch and transformers are imported once (an hf project's train.py imports cost ~6 CPU-s a
process). train.py runs this way as one process without torchrun (a 1-rank process group, left before the next)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

from tests.conftest import project_modules, torchrun_env

# Runs scripts of a project, one after the other, in one process: torch (and transformers) are imported once, which
# takes seconds on 2 cores. Prints [exit code, stdout, stderr] of each run, as JSON.
DRIVER = """
import contextlib, io, json, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit:
            code = 0 if exit.code is None else exit.code  # sys.exit(None), as python exits: 0
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_scripts(project: Path, *runs: list[str]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each run, a script of `project` and its arguments."""
    # One thread (torchrun_env): more only add contention on 2 cores.
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], cwd=project, env=torchrun_env(),
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [tuple(run) for run in json.loads(result.stdout.splitlines()[-1])]


def run_in_this_process(project: Path, script: str, *args: str) -> None:
    """`python SCRIPT ARGS` in `project`, run in the test's own process (runpy): for a script that involves nothing
    distributed (a plain-PyTorch reference), which needs no process of its own, so no torch import of its own. It
    runs on one thread, as a subprocess under torchrun_env would, and what it changes is set back after: the
    project's modules (project_modules), the folder, sys.argv, the RNG, the threads, the garbage collector."""
    import torch

    argv, threads = sys.argv, torch.get_num_threads()
    try:
        with project_modules(project), contextlib.chdir(project), torch.random.fork_rng():
            torch.set_num_threads(1)
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        # train.py and preflight.py switch the collector off while they import and freeze what the process holds
        # once loaded (for a training process, its imports): both set back for the tests that follow.
        gc.unfreeze()
        gc.enable()


def captured_in_this_process(project: Path, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python ARGV` in `project`, run in this process (run_in_this_process)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_in_this_process(project, *argv)
        except SystemExit as exit:
            code = 0 if exit.code is None else exit.code
    return code, out.getvalue(), err.getvalue()
