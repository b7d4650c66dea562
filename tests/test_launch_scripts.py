"""The launch scripts' own inputs (issue 40): their variables are checked before anything starts, and the run's
arguments mean the same to preflight.py as to train.py.

- any value of NPROC, MAX_RESTARTS or DEVICE that is not a whole number in range (or a known device) stops the
  real scripts/launch_local.sh with one line and exit code 2, before any Python process starts; the values
  that are in range pass (drawn by hypothesis: values nobody listed);
- preflight.py parses exactly train.py's arguments with train.py's parser (tests/helpers/parse_property.py,
  hypothesis inside the project): the same outcome, line for line, for drawn argument lists.

(`--world-size 4` given to launch_local.sh and the multi-node script's variables: tests/test_bad_input_runtime.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import HELPERS, TINY, torchrun_env

# The variables launch_local.sh checks, in its order: (name, the line's rule, whether a value passes).
COUNT = re.compile(r"[0-9]{1,9}")
VARIABLES = {
    "NPROC": ("a whole number from 1 to 4096", lambda v: bool(COUNT.fullmatch(v)) and 1 <= int(v) <= 4096, "2"),
    "MAX_RESTARTS": (
        "a whole number from 0 to 1000",
        lambda v: bool(COUNT.fullmatch(v)) and int(v) <= 1000,
        "1",
    ),
    "DEVICE": ("one of auto cpu cuda", lambda v: v in ("auto", "cpu", "cuda"), "auto"),
}
EDGES = ["", "0", "1", "01", "009", "4096", "4097", "1000", "1001", "-1", "+1", "1.0", "1e3", "abc", "auto", "cpu",
         "cuda", "CPU", " 1", "1 ", "1+1", "x[$(touch pwned)]", "a\nb", "٣", "²", "999999999", "9999999999",
         "18446744073709551617"]  # fmt: skip
ANY_TEXT = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"))  # what env can hold
VALUES = st.one_of(st.sampled_from(EDGES), ANY_TEXT)


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(values=st.fixed_dictionaries({name: VALUES for name in VARIABLES}))
def test_launch_variables_are_checked_before_anything_starts(
    values: dict[str, str], projects: dict[str, Path], tmp_path: Path
) -> None:
    if all(VARIABLES[name][1](values[name]) or values[name] == "" for name in VARIABLES):
        values = {**values, "DEVICE": "tpu"}  # one mistake at least: the test never starts a run
    # An empty variable is unset: the script's default.
    wrong = next(name for name in VARIABLES if values[name] != "" and not VARIABLES[name][1](values[name]))
    out = tmp_path / "out"
    result = subprocess.run(
        ["scripts/launch_local.sh", *TINY, "--job.output_dir", str(out)],
        cwd=projects["fp32"], env={**torchrun_env(), **values}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    head = f"launch_local.sh: error: {wrong} must be {VARIABLES[wrong][0]}, got "
    tail = f"; e.g. {wrong}={VARIABLES[wrong][2]}\n"
    assert (result.returncode, result.stdout) == (2, ""), (values, result.stderr)
    assert result.stderr.startswith(head) and result.stderr.endswith(tail), (values, result.stderr)
    assert result.stderr.count("\n") == 1, (values, result.stderr)  # one line, whatever the value holds
    if re.fullmatch(r"[\w+.\-\[\]$()]*", values[wrong], flags=re.ASCII):
        assert result.stderr == f"{head}'{values[wrong]}'{tail}"
    assert not out.exists()  # nothing ran: not preflight.py, not torchrun


def test_preflight_and_train_py_read_the_arguments_alike(projects: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "base.json").write_text(json.dumps(TINY))
    (tmp_path / "out").mkdir()
    result = subprocess.run(
        [sys.executable, str(HELPERS / "parse_property.py"), str(tmp_path / "base.json"), str(tmp_path / "out"),
         str(tmp_path / "report.json")],
        cwd=projects["fp32"], env={**torchrun_env(), "PYTHONPATH": f"{projects['fp32']}:{HELPERS}", "RANK": "0"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # Both kinds drawn: arguments refused (by the parser or the checks) and accepted.
    assert report["draws"] >= 40 and report["refused"] > 0 and report["accepted"] > 0, report
