"""Plain PyTorch, one process, no FSDP: the reference that sharded runs of a generated project must match.

Run inside a generated project (PYTHONPATH = the project):

    python reference_loop.py OUT_DIR --model.dim 64 ...   (the project's own config overrides)

It builds the project's Transformer eagerly, initialises it with the same seed, and trains it on the
same global batches with the project's own AdamW + schedule, clipping with torch.nn.utils.clip_grad_norm_
on ordinary tensors. Writes OUT_DIR/metrics.jsonl (step, loss, grad_norm) and OUT_DIR/final.pt (state dict).
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from config import parse_args
from data import ShuffledEpochs, SyntheticTokens, micro_batches
from model import Transformer
from train import build_optimizer

out = Path(sys.argv[1])
config = parse_args(sys.argv[2:])
training = config.training
torch.manual_seed(training.seed)
model = Transformer(config.model)
model.init_weights(seed=training.seed)
optimizer, scheduler = build_optimizer(model, training, torch.device("cpu"))
samples = ShuffledEpochs(
    SyntheticTokens(config.model.vocab_size, training.seq_len, config.data.synthetic_samples, training.seed),
    training.seed,
)
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as metrics:
    for step in range(training.steps):
        # The whole global batch at once: what N ranks x grad_accum_steps micro-batches must add up to.
        [(inputs, targets, *_)] = micro_batches(samples, step, training.global_batch_size, 1, 0, 1)
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        max_norm = training.max_norm if training.max_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        metrics.write(json.dumps({"step": step + 1, "loss": loss.item(), "grad_norm": grad_norm.item()}) + "\n")
torch.save(model.state_dict(), out / "final.pt")
