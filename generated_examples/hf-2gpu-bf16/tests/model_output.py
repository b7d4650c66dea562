"""Run by test_checkpoint.py (one process, a group of one; or under torchrun): load the newest checkpoint into the
sharded model with train.py's own blocks and save its output on a fixed input, for comparison with the exported
model."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import Checkpointer, TrainState
from model import output_logits
from train import build_model_meta, build_optimizer, checkpoint_load, run_on_every_rank


def save_model_output(config, device, mesh) -> None:
    model = build_model_meta(config, mesh, device)
    optimizer, scheduler = build_optimizer(model, config.training, device)
    state = TrainState(model, optimizer, scheduler, config.training.global_batch_size, device, run_id="test")
    output_dir = Path(config.job.output_dir)
    checkpointer = Checkpointer(output_dir / "checkpoints", config)
    assert checkpoint_load(state, checkpointer) is not None, "no checkpoint to load"
    checkpointer.close()
    # The same input on every rank: each rank computes the whole output with the all-gathered weights.
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(config.model.vocab_size, (2, config.training.seq_len), generator=generator)
    model.eval()
    with torch.no_grad():
        logits = output_logits(model(tokens.to(device))).float().cpu()
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, output_dir / "model_output.pt")


def main() -> None:
    run_on_every_rank(save_model_output, sys.argv[1:])


if __name__ == "__main__":
    main()
