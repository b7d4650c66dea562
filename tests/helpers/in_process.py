"""A generated project's script run as `python SCRIPT ARGS` would run it, but in the test's own process: for a
one-process run (a reference, a preparation) that needs no process of its own, hence no import of torch (and
transformers: ~6 CPU-s) of its own."""

from __future__ import annotations

import gc
from pathlib import Path

from tests.helpers.scripts import run_in_this_process


def script_in_this_process(project: Path, script: str, *args: str) -> None:
    """Run `python SCRIPT ARGS` in `project` in this process (run_in_this_process); fail unless it exits 0."""
    try:
        run_in_this_process(project, script, *args)
    except SystemExit as exit:  # train.py ends with sys.exit(its exit code)
        assert exit.code in (None, 0), f"{script} exited {exit.code}"
    finally:
        # train.py switches the collector off while it imports and freezes what the process holds once they are
        # loaded (for a training process, its imports): both set back for the tests that follow.
        gc.unfreeze()
        gc.enable()
