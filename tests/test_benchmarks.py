"""Each benchmark runs once in a tiny size so it cannot rot (its figures are not asserted: see RESULTS.md)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def test_generate_benchmark_runs_and_reports_ratios() -> None:
    result = subprocess.run([sys.executable, "benchmarks/generate.py", "--repeat", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("new", "copier copy", "--help", "python -c pass"):
        assert any(re.fullmatch(rf"{re.escape(name)} +\d+\.\d{{3}} s \(median of 1\)", line) for line in lines), name
    assert re.search(r"^new / copier copy += \d+\.\d\d$", result.stdout, flags=re.M)
    assert re.search(r"^--help / python -c pass = \d+\.\d\d$", result.stdout, flags=re.M)
