"""Everything tests/test_hf_context_parallel.py needs from one process, in one process (torch and transformers
imported once): preflight.py's answers to the refusal cases, then, for each run, train.py's own training in one
process (no mesh, whole sequences: the reference) and plain transformers' loss on step 1's batch
(hf_one_process.py's train_then_reference, once per model, each in a process group of one of its own).

    cd PROJECT && PYTHONPATH=. python hf_cp_reference.py CASES.json RUNS.json

CASES.json: {case: preflight.py's arguments}; RUNS.json: {run: train.py's arguments}. Prints one JSON line last:
{"preflight": {case: [exit code, stdout, stderr]}, "plain": {run: step 1's loss}}.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

import train  # the project's (PYTHONPATH and cwd: the project)
from hf_one_process import train_then_reference
from preflight_driver import run_case


def main() -> None:
    with open(sys.argv[1]) as cases_file, open(sys.argv[2]) as runs_file:
        cases, runs = json.load(cases_file), json.load(runs_file)
    found = {"preflight": {case: run_case(argv) for case, argv in cases.items()}, "plain": {}}
    for run, argv in runs.items():
        config = train.parse_args(argv)
        device, mesh = train.init_distributed(config)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = train_then_reference(config, device, mesh)
        train.close_process_group()
        if code:
            sys.exit(f"{run}: train.py exited with {code}\n{printed.getvalue()[-3000:]}")
        found["plain"][run] = float(re.search(r"plain transformers step 1 loss (\S+)", printed.getvalue()).group(1))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
