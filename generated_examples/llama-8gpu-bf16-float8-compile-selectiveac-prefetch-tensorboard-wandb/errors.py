"""How a run stops on a mistake in its input: one line from rank 0, the same exit code on every rank.

Imports no torch (config.py and the torch-free modules use it too).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

# The exit code of every mistake in the input, here and in preflight.py: the launch scripts stop on it without
# retrying.
USAGE_ERROR = 2
# A folder the launch scripts make for each launch (scripts/restarts.sh). A rank that stops on a usage error
# leaves a file there and exits with 0: torchrun, which reports any failed rank with its own traceback (and
# exit code 1), then says nothing, and the script, finding the file, exits with USAGE_ERROR instead of
# restarting the ranks, which would only fail the same way. The user sees rank 0's one line, nothing else.
USAGE_ERROR_MARKERS = "TRAIN_USAGE_ERRORS"


def stop(message: str) -> NoReturn:
    """End this rank. Every rank reaches this with the same message; only rank 0 prints it, as one line.

    The exit code is USAGE_ERROR, as for the mistakes preflight.py finds: the cause is in the input. Under a
    launch script's torchrun, 0 after leaving the script its mark (above), which the script turns into
    USAGE_ERROR. Under a bare `torchrun --max-restarts N`, the restarted ranks stop the same way without
    printing the line again (torchrun's own summary of the failed ranks follows: its exit code is 1).
    """
    already_said = remember_refusal()
    if rank() == 0 and not already_said:
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    marked = False
    if os.environ.get(USAGE_ERROR_MARKERS):
        # Every rank: on several nodes each node's launch script looks in its own folder.
        try:
            (Path(os.environ[USAGE_ERROR_MARKERS]) / "usage-error").write_text(message + "\n")
            marked = True
        except OSError:
            pass  # at worst the launch script retries, and the ranks stop here again
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # preflight.py, a plain `python train.py`: no torchrun
    if under_torchrun and not marked:
        wait_for_rank0_to_say_it()
    raise SystemExit(0 if marked and under_torchrun else USAGE_ERROR)


def wait_for_rank0_to_say_it(seconds: float = 30.0) -> None:
    """Under a bare torchrun, the first rank to exit with USAGE_ERROR makes torchrun end the others at once
    (SIGTERM): rank 0 could be ended before printing the line. So rank 0 marks, in the temporary folder, that
    it has said it, and the other ranks of its node wait for that mark before exiting. Ranks of other nodes
    do not wait: their torchrun cannot end rank 0's."""
    from ownership import launch_id

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    said = Path(tempfile.gettempdir()) / f"train-usage-error-said-{launch_id()}-{attempt}"
    if rank() == 0:
        try:
            said.touch()
        except OSError:
            pass  # at worst the other ranks wait out `seconds`
        return
    if os.environ.get("GROUP_RANK", "0") != "0":
        return
    deadline = time.monotonic() + seconds
    while not said.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def rank() -> int:
    """This process's rank: the process group's once joined (torch.distributed is imported by then), else
    torchrun's RANK. Imports no torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def remember_refusal() -> bool:
    """Under a bare torchrun that restarts its ranks (--max-restarts N): whether an earlier attempt of this
    torchrun stopped on a usage error already (and printed it); records this one. The record is a file in the
    temporary folder named after the torchrun process (ownership.launch_id), so no other torchrun reads it."""
    if os.environ.get(USAGE_ERROR_MARKERS) or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) < 1:
        return False  # a launch script's torchrun (one attempt), or no restarts: nothing to remember
    from ownership import launch_id

    record = Path(tempfile.gettempdir()) / f"train-usage-error-{launch_id()}"
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and record.exists():
        return True
    try:
        record.touch()
    except OSError:
        pass  # at worst a restart prints the line again
    return False


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
