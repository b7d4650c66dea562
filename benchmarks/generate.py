"""Generator speed: `fsdp2gen new` vs a bare `copier copy` of the same template, `--help` vs `python -c pass`.

    python benchmarks/generate.py [--repeat 5]

Prints the median wall time of each command (fresh processes, interleaved) and the ratios.
Targets: `fsdp2gen new` <= 1.0 s, `fsdp2gen --help` <= 0.3 s (the CLI imports neither torch nor copier for help).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BARE_COPY = "import copier, sys; copier.run_copy(sys.argv[1], sys.argv[2], data={'gpus': 8}, defaults=True, quiet=True)"


def wall_time(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    python = sys.executable
    times: dict[str, list[float]] = {"new": [], "copier copy": [], "--help": [], "python -c pass": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            times["new"].append(wall_time([python, "-m", "fsdp2gen", "new", f"{tmp}/new-{i}", "-y", "--gpus", "8"]))
            times["copier copy"].append(
                wall_time([python, "-c", BARE_COPY, str(REPO / "templates"), f"{tmp}/bare-{i}"])
            )
            times["--help"].append(wall_time([python, "-m", "fsdp2gen", "--help"]))
            times["python -c pass"].append(wall_time([python, "-c", "pass"]))
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"{name:<16} {value:6.3f} s (median of {args.repeat})")
    print(f"new / copier copy      = {median['new'] / median['copier copy']:.2f}")
    print(f"--help / python -c pass = {median['--help'] / median['python -c pass']:.2f}")
    print(f"new {'meets' if median['new'] <= 1.0 else 'MISSES'} the 1.0 s target; "
          f"--help {'meets' if median['--help'] <= 0.3 else 'MISSES'} the 0.3 s target")  # fmt: skip


if __name__ == "__main__":
    main()
