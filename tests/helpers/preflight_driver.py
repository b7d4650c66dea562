"""Run a generated project's preflight.py once per case in one process (importing torch once instead of
per case), and print {case id: [exit code, stdout, stderr]} as JSON.

    cd PROJECT && PYTHONPATH=. python preflight_driver.py CASES.json

CASES.json maps a case id to the argument list of `python preflight.py`. Each case runs preflight.main()
exactly as `python preflight.py ARGS` would, with sys.argv set and stdout/stderr captured.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def run_case(argv: list[str]) -> list:
    import preflight

    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = ["preflight.py", *argv]
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            preflight.main()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    return [code, stdout.getvalue(), stderr.getvalue()]


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print(json.dumps({case: run_case(argv) for case, argv in cases.items()}))


if __name__ == "__main__":
    main()
