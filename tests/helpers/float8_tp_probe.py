"""Run under torchrun inside a generated float8 project (PYTHONPATH = the project) by test_float8.py: the first step's
gradients of the model train.py builds (float8 conversion, tensor or pipeline parallelism, fully_shard), from
train.py's own train_step, as whole fp32 tensors, written by rank 0 (torch.save: parameter name -> tensor), for
each of several layouts in turn, all in one launch (a launch's process startup costs more than a tiny step):

    torchrun --nproc-per-node 4 float8_tp_probe.py tp.pt="--parallel.tp 2 --parallel.pp 1" \
        pp.pt="--parallel.tp 1 --parallel.pp 2" @OTHER_PROJECT hf-tp.pt="..." -- --model.dim 64 ...

(after `--`: train.py's overrides, for every layout). `@FOLDER` makes another generated project's modules (say, an
hf project's) build the layouts after it: the modules of the one before are forgotten and FOLDER's imported
instead (tests/helpers/several_runs.py's use_project; torch and the process group stay).

Each layout gets its own mesh of the same ranks (layout.py), its own model, its own step. The gradients are taken
where train_step hands them to its optimizer step (optimizer_step is swapped for a function that gathers them and
steps nothing); under pipeline parallelism each pp rank holds its own stages' parameters, gathered to rank 0.
tests/helpers/mixed_precision_reference.py writes the same gradients of plain PyTorch on one process (its GRADS
environment variable): the two compare tensor by tensor, which a loss or a norm, averaging the float8 rounding
away, would not.
"""

import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from several_runs import use_project

split = sys.argv.index("--")
runs = [argument.split("=", 1) for argument in sys.argv[1:split]]
common = sys.argv[split + 1 :]
device = None
for out, *overrides in runs:
    if out.startswith("@"):
        use_project(Path(out[1:]).resolve())
        continue
    train = importlib.import_module("train")
    TrainState = importlib.import_module("checkpoint_common").TrainState
    parse_args = importlib.import_module("config").parse_args
    data = importlib.import_module("data")
    ShuffledEpochs, SyntheticTokens, micro_batches = data.ShuffledEpochs, data.SyntheticTokens, data.micro_batches
    ParallelLayout = importlib.import_module("layout").ParallelLayout
    config = parse_args([*common, *overrides[0].split()])
    training = config.training
    if device is None:
        device, mesh = train.init_distributed(config)  # joins the process group (once), and the first mesh
    else:
        mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
    model = train.build_model_meta(config, mesh, device)
    optimizer, scheduler = train.build_optimizer(model, training, device)
    layout = ParallelLayout.of(config.parallel, dist.get_world_size())
    samples = ShuffledEpochs(
        SyntheticTokens(config.model.vocab_size, training.seq_len, config.data.synthetic_samples, training.seed),
        training.seed,
    )
    rank, ranks = layout.data_rank(dist.get_rank()), layout.data_ranks
    batches = micro_batches(samples, 0, training.global_batch_size, training.grad_accum_steps, rank, ranks)

    def gather_gradients(state: TrainState, _config: object, out: str = out) -> dict:
        grads = {name: param.grad.full_tensor().float() for name, param in state.model.named_parameters()}
        # Pipeline stages hold different parameters: every rank's, merged (the same tensors where ranks share them).
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, grads)
        if dist.get_rank() == 0:
            torch.save({name: grad for held in everyone for name, grad in held.items()}, out)
        return {"grad_norm": torch.zeros(())}

    train.optimizer_step = gather_gradients
    state = TrainState(model, optimizer, scheduler, training.global_batch_size, device, "probe")
    train.train_step(state, batches, config)
    state = model = optimizer = scheduler = None
train.close_process_group()
