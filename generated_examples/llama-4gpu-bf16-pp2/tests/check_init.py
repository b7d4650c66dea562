"""Run under torchrun by test_training.py: after meta init + fully_shard + to_empty + init_weights,
every parameter and buffer must equal an eager (non-meta, unsharded) model built with the same seed.

This is the check that catches the pytorch/examples FSDP2 bug (blocks left as garbage after
to_empty) and rank-local random init (every rank drawing the same shard values).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from model import Model
from train import build_model_meta, run_on_every_rank


def check_init(config, device, mesh) -> int:
    sharded = build_model_meta(config, mesh, device)
    gathered = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # A different global RNG state: initialisation must depend on training.seed only. The eager model is built
    # on the training device, so that both draw from the same kind of generator (CUDA's differs from the CPU's).
    torch.manual_seed(config.training.seed + 1)
    with torch.device(device):
        eager = Model(config.model)
    eager.init_weights(seed=config.training.seed)

    mismatches = []
    if dist.get_rank() == 0:
        expected = {name: tensor.cpu() for name, tensor in eager.state_dict().items()}
        if gathered.keys() != expected.keys():
            mismatches.append(f"keys differ: {sorted(gathered.keys() ^ expected.keys())}")
        for name in expected.keys() & gathered.keys():
            if not torch.equal(gathered[name], expected[name]):
                mismatches.append(f"{name}: max |diff| {(gathered[name] - expected[name]).abs().max():.3e}")
    # Buffers are not sharded: every rank holds them whole (non-persistent ones, like llama's rotary tables, are in
    # no state dict).
    for name, buffer in eager.named_buffers():
        if not torch.equal(sharded.get_buffer(name).cpu(), buffer.cpu()):
            mismatches.append(f"buffer {name} on rank {dist.get_rank()}")
    if mismatches:
        print("MISMATCH " + "; ".join(sorted(mismatches)), flush=True)
    else:
        print(f"rank {dist.get_rank()}: {len(gathered)} tensors equal", flush=True)
    return 1 if mismatches else 0


def main() -> None:
    run_on_every_rank(check_init, sys.argv[1:])


if __name__ == "__main__":
    main()
