"""Run by one process (no torchrun) inside a family hf project, with train.py's options: train.py's own training,
then the loss plain transformers computes on step 1's batch (from_pretrained of the same folder, its own logits,
the cross-entropy over every counted target), printed as `plain transformers step 1 loss X`.
tests/test_hf_parallel.py compares both with the same project's run on several ranks.

Given one JSON list of train.py argument lists instead (`hf_one_process.py '[[...], [...]]'`), it trains each in
turn in this one process (one import of torch and transformers for all: a launch costs ~6 CPU-s) and prints
`OUTPUT_DIR: plain transformers step 1 loss X` for each."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import train  # the project's (PYTHONPATH and cwd: the project)
from config import parse_args
from data import IGNORE, ShuffledEpochs, micro_batches
from transformers import AutoModelForCausalLM


def train_then_reference(config, device, mesh, label: str = "") -> int | None:
    code = train.train(config, device, mesh)
    training = config.training
    samples = ShuffledEpochs(train.open_datasets(config)[0], training.seed)
    # Step 1's batch, every micro-batch of it: the samples all ranks of a parallel run read together.
    batches = micro_batches(samples, 0, training.global_batch_size, training.grad_accum_steps, 0, 1)
    model = AutoModelForCausalLM.from_pretrained(config.model.folder, dtype=torch.float32)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch.inputs).logits.flatten(0, 1)
            total += F.cross_entropy(logits, batch.targets.flatten(), ignore_index=IGNORE, reduction="sum")
            count += int((batch.targets != IGNORE).sum())
    print(f"{label}plain transformers step 1 loss {float(total / count)!r}", flush=True)
    return code


def every_run(runs: list[list[str]]):
    """work for run_on_every_rank: each run's training and reference in turn, in the one process group."""

    def work(config, device, mesh) -> int | None:
        for args in runs:
            config = parse_args(args)
            code = train_then_reference(config, device, mesh, label=f"{config.job.output_dir}: ")
            if code:
                return code
        return None

    return work


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("["):
        runs = json.loads(sys.argv[1])
        train.run_on_every_rank(every_run(runs), runs[0])
    else:
        train.run_on_every_rank(train_then_reference)
