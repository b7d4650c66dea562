"""Several trainings of a family hf project in one launch (each rank imports torch and transformers once), run by
tests/test_hf_expert_parallel.py under torchrun or as one process:

    cd PROJECT && PYTHONPATH=. python hf_runs.py SPEC.json

SPEC.json: {"preflight": {case: argv of `python preflight.py`}, "runs": [[train.py options], ...]}. The preflight
cases run first (tests/helpers/preflight_driver.py's run_case) and print one JSON line {"preflight": {case: [exit
code, stdout, stderr]}}; then every run is train.py's own training, on the mesh of the first run's config; a run
whose options include --job.output_dir DIR/one-... also prints plain transformers' step 1 loss on the same batch
(tests/helpers/hf_one_process.py's reference).
"""

from __future__ import annotations

import json
import sys

import train  # the project's (PYTHONPATH and cwd: the project)
from hf_one_process import train_then_reference
from preflight_driver import run_case

spec = json.loads(open(sys.argv[1]).read())


def run_all(config, device, mesh) -> int | None:
    for index, options in enumerate(spec["runs"]):
        if index:
            config = train.parse_args(options)
        reference = "/one-" in options[options.index("--job.output_dir") + 1]
        code = (train_then_reference if reference else train.train)(config, device, mesh)
        if code:
            return code
    return None


if __name__ == "__main__":
    if spec.get("preflight"):
        print(json.dumps({"preflight": {case: run_case(argv) for case, argv in spec["preflight"].items()}}), flush=True)
    train.run_on_every_rank(run_all, spec["runs"][0])
