"""Plain PyTorch, one process, no FSDP: the reference that a generated project's mixed-precision runs must match,
computed on the machine that runs the test (reduced-precision numbers differ from one CPU's kernels to another's,
so they are never compared with numbers recorded elsewhere).

Run inside a generated project (PYTHONPATH = the project):

    python mixed_precision_reference.py OUT_DIR COMPUTE RANKS --model.dim 64 ...   (the project's overrides)

COMPUTE is fp32, bf16 or fp16; with the project's parallel.float8 the blocks' linear layers compute in float8.
It does what FSDP2's MixedPrecisionPolicy does on RANKS data-parallel ranks, by hand: each step, for each rank's
micro-batches, the fp32 master weights are cast to COMPUTE (the float8 layers keep fp32 weights, which torchao
casts to float8 itself, as FSDP2's float8 all-gather does), forward and backward run in COMPUTE, the gradients
are cast to fp32 and averaged over the ranks; the loss is model.py's, in training.loss_chunks chunks (the output
layer's gradient adds the chunks' parts in COMPUTE, as under FSDP2); fp16 scales the loss by the scaler's initial
2**16. Then the same clipping, AdamW and schedule as reference_loop.py. Writes OUT_DIR/metrics.jsonl (step, loss,
grad_norm).
"""

import json
import os
import sys
from pathlib import Path

import torch
from config import parse_args
from data import ShuffledEpochs, SyntheticTokens, micro_batches
from model import Transformer, block_classes
from torch.nn.utils.stateless import _reparametrize_module
from train import build_optimizer

out, compute, ranks = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
config = parse_args(sys.argv[4:])
training = config.training
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[compute]
loss_scale = 2.0**16 if compute == "fp16" else 1.0  # ShardedGradScaler's init_scale; no step overflows here
torch.manual_seed(training.seed)
model = Transformer(config.model)
model.init_weights(seed=training.seed)
classes = block_classes(model, config.parallel.shard_modules)
blocks = [module for module in model.modules() if type(module).__name__ in classes]
for block in blocks:
    # FSDP2 casts the floating-point inputs of every module it shards (the rotary tables too) to the compute dtype.
    block.register_forward_pre_hook(
        lambda _, args: tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    )
if getattr(config.parallel, "float8", False):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    for block in blocks:
        # The project's filter: torch._scaled_mm needs both dimensions to be multiples of 16.
        convert_to_float8_training(
            block,
            config=Float8LinearConfig(),
            module_filter_fn=lambda linear, _: linear.in_features % 16 == 0 and linear.out_features % 16 == 0,
        )
float8_weights = {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
optimizer, scheduler = build_optimizer(model, training, torch.device("cpu"))
samples = ShuffledEpochs(
    SyntheticTokens(config.model.vocab_size, training.seq_len, config.data.synthetic_samples, training.seed),
    training.seed,
)
params = dict(model.named_parameters())
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as metrics:
    for step in range(training.steps):
        grads = {name: torch.zeros_like(p) for name, p in params.items()}
        loss_sum = 0.0
        for rank in range(ranks):
            batches = micro_batches(samples, step, training.global_batch_size, training.grad_accum_steps, rank, ranks)
            for inputs, targets, *_ in batches:
                # What FSDP2 all-gathers: the fp32 master weights cast to the compute dtype.
                cast = {
                    name: (p if name in float8_weights else p.to(dtype)).detach().requires_grad_()
                    for name, p in params.items()
                }
                # The cast weights stay in the model through backward, which recomputes the loss's chunks (as
                # FSDP2 keeps the root's gathered weights until its backward ends).
                with _reparametrize_module(model, cast, tie_weights=True):
                    loss = model(inputs, targets=targets, loss_chunks=training.loss_chunks) / len(batches)
                    (loss * loss_scale).backward()
                loss_sum += loss.item()
                for name, p in cast.items():
                    # Reduce-scatter in fp32: each rank's gradient divided by the number of ranks, then summed.
                    grads[name] += p.grad.float() / loss_scale / ranks
        for name, p in params.items():
            p.grad = grads[name]
        if step == 0 and os.environ.get("GRADS"):
            torch.save(grads, os.environ["GRADS"])  # the first step's gradients (tests/helpers/float8_tp_probe.py)
        max_norm = training.max_norm if training.max_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        record = {"step": step + 1, "loss": loss_sum / ranks, "grad_norm": grad_norm.item()}
        metrics.write(json.dumps(record) + "\n")
