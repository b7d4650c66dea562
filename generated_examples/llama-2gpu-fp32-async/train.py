"""Train the model with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Launch one process per GPU with torchrun (`scripts/launch_local.sh` does this):

    torchrun --nproc-per-node 2 train.py --config config.toml --training.steps 100

`python train.py` alone runs a single process, which is handy for debugging.
The six blocks below run in this order in `train()`; their order is what makes
FSDP2 correct, so keep it when you edit them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from checkpoint import Checkpointer, TrainState
from checkpoint_common import seed_everything
from config import Config, ParallelConfig, ProfileConfig, TrainingConfig, parse_args
from data import ShuffledEpochs, SyntheticTokens, TokenFile, TokenShards, micro_batches, open_tokens
from errors import stop
from model import Transformer
from preflight import PreflightError, preflight, resuming, start_run


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
    # How long a rank waits in a collective before the run fails (a hung peer, a lost node).
    timeout = timedelta(minutes=job.timeout_minutes)
    if "RANK" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://"))
        if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size:
            # One torchrun runs every rank. It keeps one store for all its restarts (--max-restarts), where
            # restarted workers would read the addresses the previous attempt's workers left and fail to
            # connect (gloo). Its restart count, the same on every rank, gives each attempt its own keys.
            # (With several nodes each torchrun counts only its own restarts, so this would split the ranks;
            # there, give torchrun TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a fresh store per attempt, instead.)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt_{attempt}", store)
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
    return device, data_parallel_mesh(config.parallel, device)


def data_parallel_mesh(parallel: ParallelConfig, device: torch.device) -> DeviceMesh:
    """A 1-D mesh (FSDP: every rank holds 1/N of the model), or with dp_replicate > 1 a 2-D one (HSDP).

    HSDP shards within groups of dp_shard ranks (typically one node, over its fast links) and replicates
    across the dp_replicate groups: parameters are all-gathered inside a node only, and gradients are
    reduce-scattered in the node, then all-reduced across nodes. Rank r is in replica r // dp_shard.
    """
    world_size = dist.get_world_size()
    if world_size == 1:
        # A single process (`python train.py`, for debugging) has nothing to replicate or shard.
        return init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    # preflight.py made sure that dp_replicate x dp_shard is the world size.
    replicate = parallel.dp_replicate
    shard = world_size // replicate if parallel.dp_shard == -1 else parallel.dp_shard
    sizes = {"dp_replicate": replicate, "dp_shard": shard}
    # Dimensions of size 1 are left out; dp_shard always stays (fully_shard needs a mesh).
    sizes = {name: size for name, size in sizes.items() if size > 1 or name == "dp_shard"}
    return init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


# fsdp2gen: block build_model_meta
def build_model_meta(config: Config, mesh: DeviceMesh, device: torch.device) -> Transformer:
    """Build on the meta device, shard bottom-up, then allocate and initialise only local shards."""
    parallel = config.parallel
    # No memory is allocated here: a model larger than one GPU can be described on every rank.
    with torch.device("meta"):
        model = Transformer(config.model)
    reshard = parallel.reshard_after_forward
    shard_ranks = mesh["dp_shard"].size()  # the ranks a parameter is sharded over (all, unless HSDP or TP)
    if not isinstance(reshard, bool) and reshard >= shard_ranks:
        # Groups at least as large as the shard group (e.g. a run on fewer GPUs than configured): reshard fully.
        # Smaller groups divide the shard group (preflight.py checked).
        reshard = True
    # Shard each transformer block first, then the root (embeddings, final norm, output).
    # Bottom-up order gives one all-gather per block, overlapped with the previous block's compute.
    for block in model.layers:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard,
        )
    # The root keeps its parameters after forward (its default): backward needs them right away.
    fully_shard(model, mesh=mesh)
    # Allocate this rank's shards on the device. Their content is garbage until init_weights
    # fills every parameter and buffer (including the non-persistent rotary tables).
    model.to_empty(device=device)
    model.init_weights(seed=config.training.seed)
    return model


# fsdp2gen: block build_optimizer
def build_optimizer(
    model: Transformer, training: TrainingConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over the sharded parameters, so each rank keeps optimizer state for its shards only.

    Created after fully_shard: an optimizer built earlier would hold the replaced
    unsharded parameters and silently update nothing.
    """
    on_gpu = device.type == "cuda"
    trainable = list(model.parameters())
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
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    max_norm: float,
    device: torch.device,
    *,
    grad_sync: str = "every_micro_batch",
) -> tuple[float, float]:
    """One optimizer step over this rank's micro-batches; returns (loss averaged over ranks, grad norm)."""
    loss_sum = torch.zeros((), device=device)
    for index, (inputs, targets) in enumerate(batches):
        # training.grad_sync: "every_micro_batch" reduce-scatters each micro-batch into the sharded gradients
        # (1/N of the model per rank); "last_micro_batch" keeps the unsharded gradients (the whole model on
        # every rank) until the last micro-batch, then reduces once (FSDP2 has no no_sync()).
        model.set_requires_gradient_sync(grad_sync == "every_micro_batch" or index == len(batches) - 1)
        # Call model(...), never model.forward(...): FSDP2 all-gathers parameters in __call__'s hooks.
        logits = model(inputs.to(device, non_blocking=True))
        # Cross-entropy in fp32 whatever the compute dtype; dividing by the number of micro-batches
        # makes the accumulated gradient equal to the gradient of one big batch.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten()) / len(batches)
        loss.backward()
        loss_sum += loss.detach()
    # The gradients are DTensor shards; clip_grad_norm_ reduces the norm over all ranks.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    # Gloo has no AVG reduction: sum the per-rank losses, then divide.
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    return loss_sum.item() / dist.get_world_size(), grad_norm.item()


def evaluate(
    model: Transformer,
    val_samples: TokenShards | SyntheticTokens,
    config: Config,
    data_rank: int,
    data_ranks: int,
    device: torch.device,
) -> float:
    """Mean validation loss over the first eval.batches x global_batch_size validation samples.

    The samples are split over the ranks like a training step's, so the mean is over the same tokens on any
    number of GPUs.
    Every micro-batch holds as many tokens as any other, so the mean of the micro-batch means is the mean over
    all tokens.
    """
    training = config.training
    model.eval()  # no dropout (in models that have it)
    loss_sum = torch.zeros((), device=device)
    micro_batch_count = 0
    with torch.no_grad():
        for batch in range(config.eval.batches):
            for inputs, targets in micro_batches(
                val_samples, batch, training.global_batch_size, training.grad_accum_steps, data_rank, data_ranks
            ):
                logits = model(inputs.to(device, non_blocking=True))
                loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
                micro_batch_count += 1
    model.train()
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    return loss_sum.item() / (micro_batch_count * dist.get_world_size())


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


# Dense fp32 peak FLOP/s (no TF32) of known GPUs, for the MFU estimate: the first name found in the device's
# name wins, so the PCIe and NVL boards (lower clocks and power) come before their SXM namesakes.
PEAK_FLOPS = {
    "H100 PCIe": 51e12, "H100 NVL": 60e12, "H200 NVL": 60e12, "H100": 67e12, "H200": 67e12, "A100": 19.5e12,
    "L40S": 91.6e12, "A10": 31.2e12, "V100": 15.7e12,
}  # fmt: skip


def peak_flops_per_device(device: torch.device) -> float | None:
    """The device's peak from PEAK_FLOPS, or None (CPU, unknown GPU): then no MFU is reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for model, flops in PEAK_FLOPS.items() if model in name), None)


def peak_memory_mib(device: torch.device) -> float:
    """The largest peak of any rank (the one that runs out first), in MiB; a collective, so every rank calls it."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        # ru_maxrss is in KiB on Linux: the peak resident memory of this process.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    largest = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


Samples = SyntheticTokens | TokenFile | TokenShards


def open_datasets(config: Config) -> tuple[Samples, Samples | None]:
    """The training samples, and the validation samples (None when eval.every = 0); rank 0 says which."""
    data, training, vocab_size = config.data, config.training, config.model.vocab_size
    val_samples = None
    if data.path:
        train_samples = open_tokens(data.path, "train", training.seq_len, vocab_size)
        if config.eval.every:
            val_samples = open_tokens(data.path, "val", training.seq_len, vocab_size)
        described = data.path
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


class Profiler:
    """[profile]: a torch.profiler trace of steps start .. start + steps - 1 (one Chrome trace per rank in
    output_dir/profile/), and on CUDA a snapshot of the allocations up to memory_snapshot_step."""

    def __init__(self, profile: ProfileConfig, output_dir: Path, device: torch.device) -> None:
        self.profile, self.device, self.rank = profile, device, dist.get_rank()
        self.folder = output_dir / "profile"
        self.folder.mkdir(exist_ok=True)
        self.running: torch.profiler.profile | None = None
        self.last_step = profile.start + profile.steps - 1
        if profile.memory_snapshot_step and device.type == "cuda":
            # Records every allocation from here on, with its stack: the snapshot shows what held memory when.
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def step_starting(self, step: int) -> None:
        if step == self.profile.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.running = torch.profiler.profile(activities=activities, record_shapes=True)
            self.running.start()

    def step_done(self, step: int) -> None:
        if self.running is not None and step == self.last_step:
            self.close()
        if step == self.profile.memory_snapshot_step and self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-step-{step}-rank-{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        """Stop a running trace and write it (also when training ends before its last step)."""
        if self.running is None:
            return
        self.running.stop()
        first = self.profile.start
        self.running.export_chrome_trace(str(self.folder / f"steps-{first}-{self.last_step}-rank-{self.rank}.json"))
        self.running = None


def start_checked_run(config: Config, output_dir: Path) -> str:
    """Run preflight.py's checks on rank 0 (the launch scripts ran them before torchrun; `torchrun train.py`
    alone did not) and make job.output_dir this run's. Every rank gets the run id, or stops with rank 0's error."""
    shared: list = [None, None]  # run id, error
    if dist.get_rank() == 0:
        try:
            preflight(config, dist.get_world_size())
            shared[0] = start_run(output_dir, config)
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
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data_rank, data_ranks = rank, world_size
    output_dir = Path(config.job.output_dir)
    # Every mistake in the config, the data and the output folder stops the run here, before anything is built.
    run_id = start_checked_run(config, output_dir)
    check_output_dir_is_shared(output_dir, device)
    seed_everything(training.seed)

    model = build_model_meta(config, mesh, device)
    if rank == 0:
        # A DTensor's numel() is that of the whole parameter, not of this rank's shard.
        print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    optimizer, scheduler = build_optimizer(model, training, device)
    state = TrainState(model, optimizer, scheduler, training.global_batch_size, device, run_id)

    # Made before the load, on every rank: a dcp-async checkpointer creates its save group, a collective.
    checkpointer = Checkpointer(output_dir / "checkpoints", config, device)
    if resuming(config):
        resumed_from = checkpoint_load(state, checkpointer)
        if resumed_from and rank == 0:
            print(f"resumed from {resumed_from} at step {state.step}", flush=True)

    train_samples, val_samples = open_datasets(config)
    samples = ShuffledEpochs(train_samples, training.seed)
    tokens_per_step = training.global_batch_size * training.seq_len
    # Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices together.
    peak_flops = peak_flops_per_device(device)
    flops_per_token = config.model.flops_per_token(training.seq_len)
    metrics_file = None
    if rank == 0:
        # Appended to: a resumed run goes on in the same file (its rows carry the run id).
        metrics_file = open(output_dir / "metrics.jsonl", "a")
    # Zero cost when [profile] is off: no profiler exists.
    profiling = config.profile.start or config.profile.memory_snapshot_step
    profiler = Profiler(config.profile, output_dir, device) if profiling else None

    model.train()
    first_step, loop_started = state.step, time.perf_counter()
    for step in range(state.step, training.steps):
        started = time.perf_counter()
        if profiler is not None:
            profiler.step_starting(step + 1)
        batches = micro_batches(
            samples, step, training.global_batch_size, training.grad_accum_steps, data_rank, data_ranks
        )
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(
            model, optimizer, scheduler, batches, training.max_norm, device, grad_sync=training.grad_sync
        )
        elapsed = time.perf_counter() - started
        state.step = step + 1
        if profiler is not None:
            profiler.step_done(state.step)
        peak_mem_mib = peak_memory_mib(device)
        validation = None
        if val_samples is not None and (state.step % config.eval.every == 0 or state.step == training.steps):
            validation = evaluate(model, val_samples, config, data_rank, data_ranks, device)
        if metrics_file is not None:
            record = {
                "run_id": run_id,
                "step": state.step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "step_time_s": elapsed,
                "tokens_per_s": tokens_per_step / elapsed,
                # What published figures quote: throughput per GPU (per rank on CPU).
                "tokens_per_s_per_gpu": tokens_per_step / elapsed / world_size,
                "mfu": flops_per_token * tokens_per_step / elapsed / (peak_flops * world_size) if peak_flops else None,
                "peak_mem_mib": peak_mem_mib,
            }
            if validation is not None:
                # Perplexity is exp(mean loss); capped so that a diverged run still writes valid JSON.
                record |= {"val_loss": validation, "val_perplexity": math.exp(min(validation, 80.0))}
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if state.step % config.job.log_every == 0 or state.step == training.steps:
                # Time left at the average step time of this launch so far (the first steps include warm-up).
                per_step = (time.perf_counter() - loop_started) / (state.step - first_step)
                remaining = timedelta(seconds=round(per_step * (training.steps - state.step)))
                print(
                    f"step {state.step:>6}/{training.steps} | loss {loss:.4f} | lr {lr:.2e} "
                    f"| grad norm {grad_norm:.3f} | {record['tokens_per_s']:,.0f} tok/s "
                    f"({record['tokens_per_s_per_gpu']:,.0f}/GPU) | peak {peak_mem_mib:,.0f} MiB | ETA {remaining}",
                    flush=True,
                )
            if validation is not None:
                perplexity = record["val_perplexity"]
                print(
                    f"step {state.step:>6}/{training.steps} | val loss {validation:.4f} "
                    f"| val perplexity {perplexity:.2f}",
                    flush=True,
                )
        if state.step % config.checkpoint.interval == 0 or state.step == training.steps:
            checkpoint_save(state, checkpointer)
        else:
            checkpointer.after_step()

    # A save still being written in the background (dcp-async) is finished here, on every rank.
    checkpointer.close()
    if profiler is not None:
        profiler.close()
    if metrics_file is not None:
        metrics_file.close()


if __name__ == "__main__":
    main()
