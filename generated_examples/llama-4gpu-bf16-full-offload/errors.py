"""Stopping every rank together, with one line, when the cause is in the input."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from preflight import USAGE_ERROR


def stop(message: str) -> NoReturn:
    """End this rank. Every rank reaches this with the same message; only rank 0 prints it, as one line.

    The exit code is USAGE_ERROR, as for the mistakes preflight.py finds: the cause is in the input.
    """
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0:
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_ERROR)


def stop_if_rank0_failed(error: str | None) -> None:
    """Share rank 0's error (or None) with every rank, so that all stop together instead of the others
    waiting for rank 0 in their next collective."""
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        stop(shared[0])
