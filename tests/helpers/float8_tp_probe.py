"""Run under torchrun inside a generated float8 + tp project (PYTHONPATH = the project) by test_float8.py: the
first step's gradients of the model train.py builds (float8 conversion, tensor parallelism, fully_shard), from
train.py's own train_step, as whole fp32 tensors, written by rank 0 to OUT (torch.save: parameter name -> tensor).

    torchrun --nproc-per-node 4 float8_tp_probe.py OUT --model.dim 64 ...   (train.py's overrides)

The gradients are taken where train_step hands them to its optimizer step (optimizer_step is swapped for a
function that gathers them and steps nothing). tests/helpers/mixed_precision_reference.py writes the same
gradients of plain PyTorch on one process (its GRADS environment variable): the two compare tensor by tensor,
which a loss or a norm, averaging the float8 rounding away, would not.
"""

import sys

import torch
import torch.distributed as dist
import train
from checkpoint_common import TrainState
from config import parse_args
from data import ShuffledEpochs, SyntheticTokens, micro_batches
from layout import ParallelLayout

out = sys.argv[1]
config = parse_args(sys.argv[2:])
training = config.training
device, mesh = train.init_distributed(config)
model = train.build_model_meta(config, mesh, device)
optimizer, scheduler = train.build_optimizer(model, training, device)
layout = ParallelLayout.of(config.parallel, dist.get_world_size())
samples = ShuffledEpochs(
    SyntheticTokens(config.model.vocab_size, training.seq_len, config.data.synthetic_samples, training.seed),
    training.seed,
)
rank, ranks = layout.data_rank(dist.get_rank()), layout.data_ranks
batches = micro_batches(samples, 0, training.global_batch_size, training.grad_accum_steps, rank, ranks)


def gather_gradients(state: TrainState, _config: object) -> dict:
    grads = {name: param.grad.full_tensor().float() for name, param in state.model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(grads, out)
    return {"grad_norm": torch.zeros(())}


train.optimizer_step = gather_gradients
train.train_step(TrainState(model, optimizer, scheduler, training.global_batch_size, device, "probe"), batches, config)
model = optimizer = scheduler = None
train.close_process_group()
