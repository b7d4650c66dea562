"""Run inside a family hf project, under torchrun or as one process: several train.py runs in the same processes
(torch and transformers imported once, not per run), one after another, each on the mesh its own options lay out.

    cd PROJECT && PYTHONPATH=. python -m torch.distributed.run ... RUNS.json    (or: python RUNS.json)

RUNS.json: {"runs": [[name, [train.py options]], ...], "reference": [names], "preflight": {case: [options]}}.
After the runs, for each name in "reference", the loss plain transformers computes on that run's step-1 batch
(from_pretrained of its model folder, its own logits, the cross-entropy over every counted target), printed as
`plain transformers step 1 loss NAME X`; then (one process only) preflight.py's result for each case, printed as
`preflight {case: [exit code, stdout, stderr]}` (tests/helpers/preflight_driver.py's run_case).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import train  # the project's (PYTHONPATH and cwd: the project)
from config import parse_args
from data import IGNORE, ShuffledEpochs, micro_batches
from layout import ParallelLayout
from preflight_driver import run_case
from transformers import AutoModelForCausalLM

PLAN = json.loads(open(sys.argv[1]).read())
RUNS = dict(PLAN["runs"])


def plain_transformers_loss(options: list[str]) -> float:
    """Plain transformers' mean loss over step 1's batch of the run with these options (every micro-batch of every
    rank: the samples a parallel run's ranks read together)."""
    config = parse_args(options)
    training = config.training
    samples = ShuffledEpochs(train.open_datasets(config)[0], training.seed)
    batches = micro_batches(samples, 0, training.global_batch_size, training.grad_accum_steps, 0, 1)
    model = AutoModelForCausalLM.from_pretrained(config.model.folder, dtype=torch.float32)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch.inputs).logits.flatten(0, 1)
            total += F.cross_entropy(logits, batch.targets.flatten(), ignore_index=IGNORE, reduction="sum")
            count += int((batch.targets != IGNORE).sum())
    return float(total / count)


def run_all(config, device, mesh) -> int | None:
    for name, options in PLAN["runs"]:
        config = parse_args(options)
        mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
        code = train.train(config, device, mesh)
        if code:
            return code
        print(f"run {name} done", flush=True)
    for name in PLAN.get("reference", []):
        print(f"plain transformers step 1 loss {name} {plain_transformers_loss(RUNS[name])!r}", flush=True)
    if PLAN.get("preflight"):
        print("preflight " + json.dumps({case: run_case(argv) for case, argv in PLAN["preflight"].items()}))
    return None


if __name__ == "__main__":
    train.run_on_every_rank(run_all, PLAN["runs"][0][1])
