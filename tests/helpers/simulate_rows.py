"""scripts/plan_memory.py's simulate() for several configs of one or more generated projects, in one process, one
JSON line each: `plan_memory.py --config C --gpus N --json`'s main(), as a launch of it prints it.

    python simulate_rows.py PROJECT CONFIG GPUS [PROJECT CONFIG GPUS ...]

GPUS may carry more of the script's arguments after the number, in the same word ("4 --parallel.cp 1"). GPUS
"text:N": the script's main() without --json (`plan_memory.py --config C --gpus N`, the text a user reads, or
its refusal of bad input), its stdout, stderr and exit status captured and printed as one JSON line
{"stdout", "stderr", "exit"}: what a launch of it would print and return, in the process already running.

One process for every row instead of one per row (or per project): torch, transformers and FSDPMemTracker are
imported once, and fake tensors' dispatch cache (FakeTensorMode's, shared by every mode in a process) serves the
ops that rows of the same shapes repeat. Each simulate() has its own fake process group, model and tracker. Each
project's modules (train.py, config.py, scripts/plan_memory.py, ...) are imported from its own folder, the previous
project's set aside first (the projects' modules have the same names), with that project as the working directory.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import sys
from pathlib import Path


def load(project: Path, previous: Path | None):
    """`project`'s plan_memory, imported fresh: the modules and sys.path entries of `previous` gone."""
    if previous is not None:
        for name, module in list(sys.modules.items()):
            if Path(getattr(module, "__file__", None) or "/").is_relative_to(previous):
                del sys.modules[name]
        sys.path[:] = [entry for entry in sys.path if not Path(entry or ".").resolve().is_relative_to(previous)]
    os.chdir(project)
    sys.path[:0] = [str(project / "scripts"), str(project)]
    plan_memory = importlib.import_module("plan_memory")
    gc.collect()
    gc.freeze()  # torch and the project, imported once, outlive its rows: the collector's full passes skip them
    return plan_memory


triples = sys.argv[1:]
previous = None
for project, config, gpus in zip(triples[::3], triples[1::3], triples[2::3], strict=True):
    project = Path(project).resolve()
    if project != previous:
        plan_memory = load(project, previous)
        previous = project
    # The script's own `--json` output (main(): its arguments, simulate(), the JSON line), as a launch prints it.
    # main() freezes what is alive (gc.freeze): the previous row's garbage collected first.
    gc.collect()
    text = gpus.startswith("text:")
    gpus, *more = gpus.removeprefix("text:").split()
    sys.argv = ["plan_memory.py", "--config", config, "--gpus", gpus, *more, *([] if text else ["--json"])]
    if not text:
        plan_memory.main()
    else:
        out, err, status = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                plan_memory.main()
            except SystemExit as exit:  # argparse's parser.exit: the status a launch would return
                status = exit.code if isinstance(exit.code, int) else 1
        print(json.dumps({"stdout": out.getvalue(), "stderr": err.getvalue(), "exit": status}))
    sys.stdout.flush()
