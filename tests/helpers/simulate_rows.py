"""Run inside a generated project (its folder first on sys.path): scripts/plan_memory.py's simulate() for several
configs in one process, one JSON line each, as `plan_memory.py --config C --gpus N --json` prints it.

    python simulate_rows.py CONFIG GPUS [CONFIG GPUS ...]

One process for a project's rows instead of one per row: torch, transformers and FSDPMemTracker are imported
once, and fake tensors' dispatch cache (FakeTensorMode's, shared by every mode in a process) serves the ops that
rows of the same shapes repeat. Each simulate() has its own fake process group, model and tracker.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "scripts"))
import plan_memory  # noqa: E402
from config import parse_args  # noqa: E402

gc.freeze()  # torch and the project, imported once, outlive every row: the collector's full passes skip them
pairs = sys.argv[1:]
for config, gpus in zip(pairs[::2], pairs[1::2], strict=True):
    print(json.dumps(plan_memory.simulate(parse_args(["--config", config]), int(gpus))), flush=True)
