"""Run under torchrun inside a generated project (PYTHONPATH = the project) by test_precision.py.

bf16: records the dtype the first block's weights have *inside* forward, the sharded master dtype and the logits'
dtype, for a model built with each parallel.output_dtype in turn (one launch for both).
fp16: injects an inf into one gradient shard on rank 1 only and records, per rank, whether the step was
skipped (parameters unchanged) and the loss scale before and after.
Each rank writes its report to $PROBE_OUT/rank<N>.json (ranks printing to one stdout interleave).
"""

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from config import parse_args
from data import ShuffledEpochs, SyntheticTokens, micro_batches
from train import TrainState, build_model_meta, build_optimizer, close_process_group, init_distributed, train_step

config = parse_args(sys.argv[2:])
device, mesh = init_distributed(config)
rank = dist.get_rank()
samples = ShuffledEpochs(SyntheticTokens(config.model.vocab_size, config.training.seq_len, 64, 0), 0)
batches = micro_batches(samples, 0, config.training.global_batch_size, 1, rank, dist.get_world_size())
report: dict = {"rank": rank}

if sys.argv[1] == "bf16":
    seen = {}

    def record_dtype(module: torch.nn.Module, args: tuple) -> None:
        # Inside forward FSDP2 has all-gathered the block: these are the compute parameters.
        seen["dtype"] = str(module.wq.weight.dtype)

    for output_dtype in ("float32", "compute"):
        config.parallel.output_dtype = output_dtype
        model = build_model_meta(config, mesh, device)
        model.layers["0"].attention.register_forward_pre_hook(record_dtype)
        seen.clear()
        logits = model(batches[0][0])
        master = model.layers["0"].attention.wq.weight.dtype
        report[output_dtype] = dict(inside_forward=seen["dtype"], master=str(master), logits=str(logits.dtype))
    optimizer = scheduler = None
else:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = build_model_meta(config, mesh, device)
    optimizer, scheduler = build_optimizer(model, config.training, device)

    class InfOnRankOne(ShardedGradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            if rank == 1:  # one element of one local shard: only rank 1 can see the overflow
                model.layers["0"].feed_forward.w1.weight.grad.to_local().view(-1)[0] = math.inf
            super().unscale_(optimizer)

    scaler = InfOnRankOne(device.type)
    before = [p.to_local().clone() for p in model.parameters()]
    scale_before = scaler.get_scale()
    state = TrainState(model, optimizer, scheduler, scaler, config.training.global_batch_size, device, "probe")
    train_step(state, batches, config)
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=True))
    report.update(params_unchanged=unchanged, scale_before=scale_before, scale_after=scaler.get_scale())
Path(os.environ["PROBE_OUT"], f"rank{rank}.json").write_text(json.dumps(report))
# Free the sharded model before tearing the group down, as the generated train.py does.
model = optimizer = scheduler = None
close_process_group()
