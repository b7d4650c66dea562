"""preflight.py and train.py read a run's arguments with one parser (issue 40), checked with hypothesis inside a
generated project (one process: torch and the project's modules are imported once):

    cd PROJECT && PYTHONPATH=PROJECT:HELPERS python parse_property.py BASE.json OUT_ROOT REPORT.json

For drawn argument lists (options of preflight, of torchrun, of the config, values, stray words, in any order),
`python preflight.py --world-size 2 ARGS` does exactly what train.py does with ARGS on rank 0 of 2 ranks: its
parser (config.parse_args), then the checks (preflight.preflight): the same exit code and the same output, so
what one accepts the other accepts, and what one refuses the other refuses with the same line. BASE.json holds
the base arguments (a tiny model on the CPU), put before the drawn ones; each draw gets its own output folder
under OUT_ROOT. Writes {"draws", "refused", "accepted"} to REPORT.json; an assertion error (with the draw)
otherwise. HYPOTHESIS_PROFILE=nightly draws more.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from preflight_driver import run_case  # tests/helpers/ is on the path

PROFILES = {"ci": 40, "nightly": 400}
# Words a user may put among a launch script's extra arguments: its own and torchrun's options among the run's.
TOKENS = [
    "--world-size", "--world-size=4", "--world_size", "4", "0", "-1", "2", "--nproc-per-node", "--nnodes",
    "--config", "config.toml", "nope.toml", "--config=config.toml", "--training.steps", "--training.steps=2", "3",
    "--job.device", "cpu", "tpu", "--model.dim", "--training", "--", "-h", "stray", "",
]  # fmt: skip


def as_train_py(argv: list[str]) -> list:
    """[exit code, stdout, stderr] of train.py's start on rank 0 with `argv`: parse_args, then preflight(config,
    2), a refusal printed by errors.stop (named as preflight.py prints it, to compare the lines)."""
    import preflight
    from config import parse_args
    from errors import stop

    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = ["preflight.py", *argv]
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            config = parse_args(argv)
            try:
                preflight.preflight(config, 2)
            except preflight.PreflightError as exc:
                stop(str(exc))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    return [code, stdout.getvalue(), stderr.getvalue()]


def main() -> None:
    base_file, out_root, report_file = sys.argv[1:4]
    base = json.loads(Path(base_file).read_text())
    report = {"draws": 0, "refused": 0, "accepted": 0}

    @settings(max_examples=PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")], derandomize=True, deadline=None,
              database=None, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(drawn=st.lists(st.sampled_from(TOKENS), min_size=1, max_size=5))
    def same_outcome(drawn: list[str]) -> None:
        out = tempfile.mkdtemp(prefix="out-", dir=out_root)
        argv = [*base, "--job.output_dir", out, *drawn]
        preflight_result = run_case(["--world-size", "2", *argv])
        train_result = as_train_py(argv)
        assert preflight_result == train_result, (drawn, preflight_result, train_result)
        report["draws"] += 1
        report["refused" if preflight_result[0] == 2 else "accepted"] += 1

    same_outcome()
    Path(report_file).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
