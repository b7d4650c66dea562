"""Train the model with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Launch one process per GPU with torchrun (`scripts/launch_local.sh` does this):

    torchrun --nproc-per-node 2 train.py --config config.toml --training.steps 100

`python train.py` alone runs a single process, which is handy for debugging.
The six blocks below run in this order: `init_distributed` in `run_on_every_rank()`,
the other five in `train()`; their order is what makes FSDP2 correct, so keep it
when you edit them.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # Importing torch makes about a million objects that live as long as the process; with the collector on, its
    # passes walk them again and again while they load (about 0.4 s of CPU per rank). It is switched back on in
    # run_on_every_rank(), once they are frozen. (Hence E402 for the imports below, in pyproject.toml.)
    gc.disable()

import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR

from checkpoint import Checkpointer, TrainState
from checkpoint_common import seed_everything
from config import Config, ParallelConfig, TrainingConfig, parse_args
from data import (
    IGNORE,
    MicroBatch,
    ShuffledEpochs,
    SyntheticTokens,
    TokenFile,
    TokenShards,
    describe_data,
    micro_batches,
    open_tokens,
)
from errors import stop
from layout import ParallelLayout
from metrics import MetricsLog
from model import balance_experts, block_classes, build_model, initialize
from model import loss as model_loss
from ownership import attempt_prefix, die_with_launcher, launch_id
from preflight import PreflightError, preflight, start_run
from profiling import Profiler


# fsdp2gen: block init_distributed
def init_distributed(config: Config) -> tuple[torch.device, DeviceMesh]:
    """Join the process group torchrun set up, pin this process to its own device, and lay out the mesh."""
    job = config.job
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if job.device == "cuda" and not torch.cuda.is_available():
        stop("job.device = 'cuda' but no CUDA device is visible; use --job.device cpu")
    if job.device == "cuda" or (job.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank)
        # Set the device before creating the process group so NCCL binds this rank to its own GPU.
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # How long a rank waits in a collective before the run fails (a hung peer, a lost node). It covers a save's
    # pauses too: while rank 0 gathers and writes a full checkpoint (about 12 bytes per parameter), every other
    # rank waits in its next collective.
    timeout = timedelta(minutes=job.timeout_minutes)
    if "RANK" in os.environ:
        prefix = attempt_prefix()  # before the rendezvous: a restart that cannot work is refused first
        store, rank, world_size = next(dist.rendezvous("env://"))
        if prefix:
            store = dist.PrefixStore(prefix, store)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            device_id=device if device.type == "cuda" else None,
            timeout=timeout,
        )
    else:
        # Started without torchrun: a group of one, no rendezvous needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # The mesh of config.parallel (layout.py): FSDP over every rank, or HSDP with dp_replicate > 1.
    return device, ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)


# fsdp2gen: block build_model_meta
def build_model_meta(config: Config, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Build on the meta device, shard bottom-up, then allocate only local shards and fill them.

    The order is what makes this correct: fully_shard must see the final modules, so whatever changes the blocks'
    modules (wrappers) runs before it. materialize then allocates only the shards that
    fully_shard left on this rank.
    """
    # No memory is allocated here: a model larger than one GPU can be described on every rank.
    with torch.device("meta"):
        model = build_model(config)
    return parallelize(model, config, mesh, device)


def parallelize(model: nn.Module, config: Config, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """build_model_meta's sequence on a meta model: wrappers, fully_shard, then materialize."""
    parallel = config.parallel
    # What fully_shard shards over (layout.py): the data-parallel dimensions.
    fsdp_mesh = ParallelLayout.of(parallel, dist.get_world_size()).fsdp_mesh(mesh)
    blocks = modules_to_shard(model, block_classes(model, parallel.shard_modules))
    shard_model(model, [block for _, block in blocks], fsdp_mesh, parallel)
    materialize(model, config, device)
    return model


def modules_to_shard(model: nn.Module, class_names: list[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of the submodules whose class is named in `class_names` (preflight.py checked that each
    names one); nested ones first, as fully_shard goes bottom-up."""
    found = [(name, module) for name, module in model.named_modules() if name and type(module).__name__ in class_names]
    return sorted(found, key=lambda item: -item[0].count("."))


def shard_model(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, parallel: ParallelConfig) -> None:
    """fully_shard each block, then the root (embeddings, final norm, output layer). Bottom-up order gives
    one all-gather per block, overlapped with the previous block's compute."""
    block_options, root_options = sharding_options(mesh, parallel)
    for block in blocks:
        fully_shard(block, **block_options)
    fully_shard(model, **root_options)


def sharding_options(mesh: DeviceMesh, parallel: ParallelConfig) -> tuple[dict, dict]:
    """fully_shard's options (keyword arguments) for the blocks, and for the root."""
    reshard = parallel.reshard_after_forward
    shard_ranks = mesh.size(mesh.ndim - 1)  # the ranks a parameter is sharded over (all, unless HSDP or TP)
    if not isinstance(reshard, bool) and reshard >= shard_ranks:
        # Groups at least as large as the shard group (e.g. a run on fewer GPUs than configured): reshard fully.
        # Smaller groups divide the shard group (preflight.py checked).
        reshard = True
    # The root keeps its parameters after forward (its default): backward needs them right away. Tied input and
    # output embeddings are one parameter, so they share the root's group (torch >= 2.13 refuses to split a
    # shared parameter across groups).
    block_options: dict = {"mesh": mesh, "reshard_after_forward": reshard}
    root_options: dict = {"mesh": mesh}
    return block_options, root_options


def materialize(model: nn.Module, config: Config, device: torch.device) -> None:
    """Allocate this rank's shards, then fill them (model.py's initialize: initialise, or load weights)."""
    model.to_empty(device=device)
    # The memory holds garbage until initialize fills every parameter and buffer (including non-persistent
    # ones such as rotary tables, which no checkpoint holds).
    initialize(model, config, device)


# fsdp2gen: block build_optimizer
def build_optimizer(
    model: nn.Module, training: TrainingConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over the sharded parameters, so each rank keeps optimizer state for its shards only.

    Created after fully_shard: an optimizer built earlier would hold the replaced
    unsharded parameters and silently update nothing.
    """
    # The fused AdamW kernel runs on the GPU.
    on_gpu = device.type == "cuda"
    # Frozen parameters (requires_grad False) get no optimizer state.
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Norm weights (the only 1-D parameters) are not decayed.
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=training.lr,
        betas=(0.9, 0.95),
        fused=on_gpu,
        foreach=not on_gpu,
    )

    def warmup_cosine(step: int) -> float:
        if step < training.warmup_steps:
            return (step + 1) / training.warmup_steps
        progress = (step - training.warmup_steps) / max(1, training.steps - training.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return training.lr_min_ratio + (1.0 - training.lr_min_ratio) * cosine

    return optimizer, LambdaLR(optimizer, warmup_cosine)


# fsdp2gen: block train_step
def train_step(
    state: TrainState,
    batches: list[MicroBatch],
    config: Config,
) -> dict[str, float | torch.Tensor]:
    """One optimizer step over this rank's micro-batches. Returns the step's numbers for metrics.jsonl: the loss
    averaged over ranks, the learning rate the step used, and optimizer_step's. The loss and optimizer_step's
    numbers are device tensors: reading them here (.item()) would make the host wait for the device every step;
    metrics.py copies them on the steps that report."""
    model, device = state.model, state.device
    lr = state.scheduler.get_last_lr()[0]
    # Targets equal to IGNORE are not counted: a chat prompt's tokens (--task sft), and with data.document_mask
    # a document's last token (the next document's first is not its to predict). The loss is the mean over the
    # targets of the whole step, every micro-batch of every rank: each token weighs the same wherever it falls
    # (a mean of per-rank means would weigh one rank's few targets as much as another's many).
    # Counted on the host, where the batches still are (a count read from the device would be a sync per step).
    targets_in_step = sum((batch.targets != IGNORE).sum() for batch in batches).to(device)
    dist.all_reduce(targets_in_step, op=dist.ReduceOp.SUM)
    # FSDP averages the gradients over the ranks: multiplying by the world size makes that average their sum.
    scale = dist.get_world_size() / targets_in_step.clamp(min=1)
    loss_sum = forward_backward(state, batches, config, scale)
    numbers = optimizer_step(state, config)
    # A mixture-of-experts model sums the tokens each expert received this step over the ranks and moves its
    # routing biases (model.py; no-op for a dense model): the load figures go to metrics.jsonl.
    numbers |= balance_experts(model, config)
    # Gloo has no AVG reduction: sum the per-rank losses, then divide (in float64, as Python divides a float).
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    return {"loss": loss_sum.double() / dist.get_world_size(), "lr": lr, **numbers}


def forward_backward(
    state: TrainState,
    batches: list[MicroBatch],
    config: Config,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Forward and backward of each micro-batch, its loss summed over its targets and multiplied by `scale`; the
    scaled losses summed (this rank's share of the step's mean loss)."""
    model, device, training = state.model, state.device, config.training
    loss_sum = torch.zeros((), device=device)
    # model.py's loss calls model(...), never model.forward(...): FSDP2 all-gathers parameters in __call__'s hooks.
    # Its logits are computed training.loss_chunks sequence chunks at a time (chunked_loss.py).
    chunks = training.loss_chunks
    for index, batch in enumerate(batches):
        # training.grad_sync: "every_micro_batch" reduce-scatters each micro-batch into the sharded gradients
        # (1/N of the model per rank); "last_micro_batch" keeps the unsharded gradients (the whole model on
        # every rank) until the last micro-batch, then reduces once (FSDP2 has no no_sync()).
        model.set_requires_gradient_sync(training.grad_sync == "every_micro_batch" or index == len(batches) - 1)
        # model_loss(model, *batch): the inputs, targets and (with data.document_mask) the tokens' positions and
        # document ids, loss's arguments in its order (data.MicroBatch).
        batch = batch.to(device)
        # Cross-entropy in fp32 whatever the compute dtype (model.py's loss), summed over this micro-batch's
        # targets and scaled so that the accumulated gradient is that of the mean over all the step's targets.
        loss = model_loss(model, *batch, reduction="sum", chunks=chunks) * scale
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def optimizer_step(state: TrainState, config: Config) -> dict[str, torch.Tensor]:
    """Clip the accumulated gradients, step the optimizer and the schedule; returns the numbers for metrics.jsonl."""
    model, optimizer, max_norm = state.model, state.optimizer, config.training.max_norm
    limit = max_norm if max_norm > 0 else math.inf  # 0: no clipping, the norm still measured for metrics.jsonl
    grad_norm = clip_grad_norm(list(model.parameters()), limit)
    optimizer.step()
    numbers = {"grad_norm": grad_norm}
    optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    return numbers


def clip_grad_norm(
    parameters: list[torch.nn.Parameter],
    max_norm: float,
) -> torch.Tensor:
    """clip_grad_norm_ for gradients that are DTensor shards on any number of meshes (it refuses to mix meshes).

    The norm per mesh is reduced over that mesh's ranks, the norms are combined, then one clip for all. (With
    tensor parallelism a module left out of its plan stays on the data-parallel mesh alone.)"""
    by_mesh: dict[DeviceMesh, list[torch.nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor() for group in by_mesh.values()]
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def evaluate(
    model: nn.Module,
    val_samples: TokenShards | SyntheticTokens,
    config: Config,
    data_rank: int,
    data_ranks: int,
    device: torch.device,
) -> float:
    """Mean validation loss over the first eval.batches x global_batch_size validation samples.

    The samples are split over the ranks like a training step's, so the mean is over the same tokens on any
    number of GPUs.
    """
    training = config.training
    model.eval()  # no dropout (in models that have it)
    totals = torch.zeros(2, device=device)  # the loss summed over the targets, and their number
    chunks = training.loss_chunks  # the loss's logits, computed this many sequence chunks at a time
    with torch.no_grad():
        for batch in range(config.eval.batches):
            micros = micro_batches(
                val_samples, batch, training.global_batch_size, training.grad_accum_steps, data_rank, data_ranks
            )
            for micro in micros:
                micro = micro.to(device)
                counted = (micro.targets != IGNORE).sum()  # targets the loss counts (IGNORE: see data.py)
                totals[0] += model_loss(model, *micro, reduction="sum", chunks=chunks)
                totals[1] += counted
    model.train()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1].clamp(min=1)).item()


# fsdp2gen: block checkpoint_save
def checkpoint_save(state: TrainState, checkpointer: Checkpointer) -> None:
    """Save `state` as checkpoints/step-N/ (how: checkpoint.py) and say how long the training loop waited."""
    started = time.perf_counter()
    checkpointer.save(state)
    if dist.get_rank() == 0:
        print(checkpointer.SAVE_LINE.format(step=state.step, seconds=time.perf_counter() - started), flush=True)


# fsdp2gen: block checkpoint_load
def checkpoint_load(state: TrainState, checkpointer: Checkpointer) -> Path | None:
    """Load the newest complete checkpoint into `state` (how: checkpoint.py); None if there is none yet."""
    return checkpointer.load(state)


Samples = SyntheticTokens | TokenFile | TokenShards


def open_datasets(config: Config) -> tuple[Samples, Samples | None]:
    """The training samples, and the validation samples (None when eval.every = 0); rank 0 says which."""
    data, training, vocab_size = config.data, config.training, config.model.vocab_size
    val_samples = None
    if data.path:
        # data.document_mask: the samples carry where documents start (positions and document ids per token).
        train_samples = open_tokens(data.path, "train", training.seq_len, vocab_size, data.document_mask)
        if config.eval.every:
            val_samples = open_tokens(data.path, "val", training.seq_len, vocab_size, data.document_mask)
        described = describe_data(data.path, train_samples)
    else:
        train_samples = SyntheticTokens(vocab_size, training.seq_len, data.synthetic_samples, training.seed)
        if config.eval.every:
            # Held out: sequences of the same kind from another seed.
            val_samples = SyntheticTokens(
                vocab_size, training.seq_len, config.eval.batches * training.global_batch_size, training.seed + 1
            )
        described = "SYNTHETIC tokens (data.path is empty), a learnable pattern, not text"
    if dist.get_rank() == 0:
        held_out = f", {len(val_samples):,} validation samples" if val_samples is not None else ", no validation"
        print(f"data: {described}: {len(train_samples):,} training samples{held_out}", flush=True)
        if not data.path:
            print("data: to train on text, prepare it with scripts/prepare_data.py and pass --data.path", flush=True)
    return train_samples, val_samples


def start_checked_run(config: Config, output_dir: Path) -> str:
    """Run preflight.py's checks on rank 0 (the launch scripts ran them before torchrun; `torchrun train.py`
    alone did not) and make job.output_dir this run's: rank 0 locks it until it exits. Every rank gets the run
    id, or stops with rank 0's error (another run holding the folder, too: exit code 2, never retried)."""
    # Each node's launcher may have its own launch id: run.json records them all, so that a restart whose rank 0
    # is on another node still continues this run.
    launch_ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(launch_ids, launch_id())
    shared: list = [None, None]  # run id, error
    if dist.get_rank() == 0:
        try:
            preflight(config, dist.get_world_size())
            shared[0] = start_run(output_dir, config, sorted(set(launch_ids)))
        except PreflightError as exc:
            shared[1] = str(exc)
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        stop(shared[1])
    return shared[0]


def check_output_dir_is_shared(output_dir: Path, device: torch.device) -> None:
    """Stop unless every node sees rank 0's job.output_dir. In a node-local folder, step-N/ would be published
    without the other nodes' shards, which only a resume would find out."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) == dist.get_world_size():
        return  # one node
    token = [f".shared-check-{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(token, src=0)
    marker = output_dir / token[0]
    if dist.get_rank() == 0:
        marker.write_text(token[0])
    dist.barrier()
    missing = torch.tensor([0 if marker.is_file() else 1], device=device)
    dist.all_reduce(missing)
    dist.barrier()
    if dist.get_rank() == 0:
        marker.unlink()
    if missing.item():
        stop(
            f"job.output_dir {output_dir} is not shared by all nodes: {missing.item()} rank(s) do not see the file "
            "rank 0 wrote there; put it on a filesystem every node mounts (NFS, Lustre, ...)"
        )


def main() -> None:
    run_on_every_rank(train)


def run_on_every_rank(
    work: Callable[[Config, torch.device, DeviceMesh], int | None], args: list[str] | None = None
) -> NoReturn:
    """Parse the config, join the process group, run work(config, device, mesh) and exit with the code it
    returns (None: 0), every rank leaving the process group together: also when stop() ends the work."""
    # Everything imported so far (torch's millions of objects) lives as long as the process: keep it out of the
    # garbage collector's full passes, which would otherwise walk it during every build, checkpoint and teardown
    # (about 2 s of CPU per rank on a small run). Only objects made from here on are collected, with the collector
    # on again (it was off while the imports ran: top of this file).
    gc.freeze()
    gc.enable()
    die_with_launcher()  # a killed torchrun or launch script leaves no rank behind
    config = parse_args(args)
    device, mesh = init_distributed(config)
    try:
        exit_code = work(config, device, mesh)
    except SystemExit as exc:
        # stop(): every rank stops together, so they leave the process group together too. Another error
        # (on one rank only) propagates: a barrier here would wait for ranks that never come.
        exit_code = exc.code
    close_process_group()
    sys.exit(exit_code)


def close_process_group() -> None:
    """Leave the process group, on every rank together, once the models built in this process are garbage."""
    # Collect the models and optimizers, and the process-group references FSDP keeps in them, now (FSDP
    # modules sit in reference cycles), while the interpreter is fully alive: freed at interpreter exit
    # instead, gloo's threads can abort the process (SIGABRT, "terminate called without an active exception").
    gc.collect()
    # Without this barrier a rank can tear down gloo/NCCL while a peer is still in a collective.
    dist.barrier()
    dist.destroy_process_group()


def train(config: Config, device: torch.device, mesh: DeviceMesh) -> None:
    """Build, resume, and train to training.steps, checkpointing on the way."""
    training = config.training
    output_dir = Path(config.job.output_dir)
    # Every mistake in the config, the data and the output folder stops the run here, before anything is built.
    run_id = start_checked_run(config, output_dir)
    check_output_dir_is_shared(output_dir, device)
    seed_everything(training.seed)

    model = build_model_meta(config, mesh, device)
    describe_model(model, device)
    optimizer, scheduler = build_optimizer(model, training, device)
    global_batch = training.global_batch_size  # samples per step, all ranks together
    state = TrainState(model, optimizer, scheduler, global_batch, device, run_id)
    # Made before the load, on every rank: a dcp-async checkpointer creates its save group, a collective.
    checkpointer = Checkpointer(output_dir / "checkpoints", config)
    # Any checkpoint here is this run's: a new run (checkpoint.resume = "never") started in a folder without
    # one, and finds only its own when its launch restarts it (run_folder.check_run_folder).
    resumed_from = checkpoint_load(state, checkpointer)
    if resumed_from and dist.get_rank() == 0:
        print(f"resumed from {resumed_from} at step {state.step}", flush=True)

    train_samples, val_samples = open_datasets(config)
    samples = ShuffledEpochs(train_samples, training.seed)
    # Which slice of each batch this rank reads, of how many (layout.py knows which ranks read the same samples).
    layout = ParallelLayout.of(config.parallel, dist.get_world_size())
    data_rank, data_ranks = layout.data_rank(dist.get_rank()), layout.data_ranks
    metrics = MetricsLog(config, output_dir, run_id, device, first_step=state.step)
    # Zero cost when [profile] is off: no profiler exists.
    profiling = config.profile.start or config.profile.memory_snapshot_step
    profiler = Profiler(config.profile, output_dir, device) if profiling else None

    model.train()
    for step in range(state.step, training.steps):
        started = time.perf_counter()
        if profiler is not None:
            profiler.step_starting(step + 1)
        batches = micro_batches(
            samples, step, training.global_batch_size, training.grad_accum_steps, data_rank, data_ranks
        )
        numbers = train_step(state, batches, config) | {"step_time_s": time.perf_counter() - started}
        state.step = step + 1
        if profiler is not None:
            profiler.step_done(state.step)
        validation = None
        if val_samples is not None and (state.step % config.eval.every == 0 or state.step == training.steps):
            metrics.wait_for_device()  # the training steps' own time, not validation's
            validation = evaluate(model, val_samples, config, data_rank, data_ranks, device)
        metrics.log(state.step, numbers, validation)
        if state.step % config.checkpoint.interval == 0 or state.step == training.steps:
            checkpoint_save(state, checkpointer)
        else:
            checkpointer.after_step()

    # A save still being written in the background (dcp-async) is finished here, on every rank.
    checkpointer.close()
    if profiler is not None:
        profiler.close()
    metrics.close()


def describe_model(model: nn.Module, device: torch.device) -> None:
    """Rank 0 prints the model's size."""
    if dist.get_rank() != 0:
        return
    # A DTensor's numel() is that of the whole parameter, not of this rank's shard.
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable_note = "" if trainable == total else f", {trainable:,} of them trainable (the others frozen)"
    print(f"model: {total:,} parameters{trainable_note}", flush=True)


if __name__ == "__main__":
    main()
