"""How a run stops on a mistake in its input: one line from rank 0, the same exit code on every rank.

Imports no torch at import time (torch.distributed only when a rank stops): the torch-free modules use reason().
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

# The exit code of every mistake in the input, here and in preflight.py: the launch scripts stop on it without
# retrying.
USAGE_ERROR = 2
# A folder the launch scripts make for each launch (scripts/restarts.sh). torchrun reports any failed rank with
# exit code 1, so a rank that stops on a usage error also leaves a file there: the script then exits with
# USAGE_ERROR instead of restarting the ranks, which would only fail the same way.
USAGE_ERROR_MARKERS = "TRAIN_USAGE_ERRORS"


def stop(message: str) -> NoReturn:
    """End this rank. Every rank reaches this with the same message; only rank 0 prints it, as one line.

    The exit code is USAGE_ERROR, as for the mistakes preflight.py finds: the cause is in the input.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0:
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    if os.environ.get(USAGE_ERROR_MARKERS):
        # Every rank: on several nodes each node's launch script looks in its own folder.
        try:
            (Path(os.environ[USAGE_ERROR_MARKERS]) / "usage-error").write_text(message + "\n")
        except OSError:
            pass  # at worst the launch script retries, and the ranks stop here again
    raise SystemExit(USAGE_ERROR)


def stop_if_rank0_failed(error: str | None) -> None:
    """Share rank 0's error (or None) with every rank, so that all stop together instead of the others
    waiting for rank 0 in their next collective."""
    import torch.distributed as dist

    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        stop(shared[0])


def reason(exc: BaseException) -> str:
    """An exception as a short reason: its type and the first line of its message."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"
