"""train.py, except that rank 1 kills itself with SIGKILL during the first attempt, mid-training.

test_training.py runs it under `torchrun --max-restarts 1`: torchrun must restart both ranks, which
resume from the newest complete checkpoint and end exactly where an uninterrupted run ends. Rank 1
dies after the first optimizer step >= KILL_AFTER_STEP at which a complete checkpoint exists.
"""

import os
import signal
from pathlib import Path

import torch.distributed as dist

import train
from checkpoint_files import complete_checkpoints
from config import parse_args


def main() -> None:
    kill_after = int(os.environ["KILL_AFTER_STEP"])
    checkpoint_dir = Path(parse_args().job.output_dir) / "checkpoints"
    doomed = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    real_train_step = train.train_step
    steps = 0

    def train_step_then_die(*args, **kwargs):
        nonlocal steps
        result = real_train_step(*args, **kwargs)
        steps += 1
        if doomed and dist.get_rank() == 1 and steps >= kill_after and complete_checkpoints(checkpoint_dir):
            print(f"rank 1: SIGKILL after step {steps}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    # main() looks train_step up in the module at every step, so this replaces it.
    train.train_step = train_step_then_die
    train.main()


if __name__ == "__main__":
    main()
