"""Train llama-8gpu-bf16 with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Launch one process per GPU with torchrun (`scripts/run_local.sh` does this):

    torchrun --nproc-per-node 8 train.py --config config.toml --training.steps 100

`python train.py` alone runs a single process, which is handy for debugging.
The six blocks below run in this order in `main()`; their order is what makes
FSDP2 correct, so keep it when you edit them.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from config import Config, JobConfig, TrainingConfig, parse_args
from data import ShuffledEpochs, SyntheticTokens, TokenFile, micro_batches
from model import Transformer


# fsdp2gen: block init_distributed
def init_distributed(job: JobConfig) -> tuple[torch.device, DeviceMesh]:
    """Join the process group torchrun set up and pin this process to its own device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if job.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("job.device = 'cuda' but no CUDA device is visible; use --job.device cpu")
    if job.device == "cuda" or (job.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank)
        # Set the device before creating the process group so NCCL binds this rank to its own GPU.
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        # Started without torchrun: a group of one, no rendezvous needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    return device, mesh


# fsdp2gen: block build_model_meta
def build_model_meta(config: Config, mesh: DeviceMesh, device: torch.device) -> Transformer:
    """Build on the meta device, shard bottom-up, then allocate and initialise only local shards."""
    # No memory is allocated here: a model larger than one GPU can be described on every rank.
    with torch.device("meta"):
        model = Transformer(config.model)
    # Compute in bf16, but keep the sharded master weights in fp32 (the optimizer updates those)
    # and reduce-scatter gradients in fp32: summing many ranks' bf16 gradients loses precision.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Shard each transformer block first, then the root (embeddings, final norm, output).
    # Bottom-up order gives one all-gather per block, overlapped with the previous block's compute.
    for block in model.layers:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=config.parallel.reshard_after_forward,
            mp_policy=mp_policy,
        )
    # The root keeps its parameters after forward (its default): backward needs them right away.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
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
    # Norm weights (the only 1-D parameters) are not decayed.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=training.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
        foreach=device.type != "cuda",
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
) -> tuple[float, float]:
    """One optimizer step over this rank's micro-batches; returns (loss averaged over ranks, grad norm)."""
    loss_sum = torch.zeros((), device=device)
    for index, (inputs, targets) in enumerate(batches):
        # Accumulate locally and reduce-scatter only on the last micro-batch (FSDP2 has no no_sync()).
        model.set_requires_gradient_sync(index == len(batches) - 1)
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


class TrainState(Stateful):
    """Everything a resume needs. DCP calls state_dict()/load_state_dict() on every rank."""

    def __init__(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # Optimizer steps taken; the data position follows from it (see data.py).
        self.step = 0

    def state_dict(self) -> dict:
        # Sharded (DTensor) model and optimizer state: each rank writes only its own shards.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]


# fsdp2gen: block checkpoint_save
def checkpoint_save(state: TrainState, checkpoint_dir: Path, keep_last: int) -> Path:
    """Sharded DCP save into step-N.tmp/, renamed to step-N/ once every rank has finished writing.

    A crash mid-save leaves only a .tmp folder, which resume ignores.
    """
    final = checkpoint_dir / f"step-{state.step}"
    staging = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    dcp.save({"train": state}, checkpoint_id=staging)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in complete_checkpoints(checkpoint_dir)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """step-N folders (never step-N.tmp), oldest first."""
    found = [p for p in checkpoint_dir.glob("step-*") if p.name.removeprefix("step-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


# fsdp2gen: block checkpoint_load
def checkpoint_load(state: TrainState, checkpoint_dir: Path) -> Path | None:
    """Load the newest complete checkpoint into `state` (resharding if the world size changed)."""
    # Rank 0 picks the folder so that every rank loads the same one even if the listing races a save.
    found = complete_checkpoints(checkpoint_dir) if dist.get_rank() == 0 else []
    choice = [str(found[-1]) if found else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    dcp.load({"train": state}, checkpoint_id=choice[0])
    return Path(choice[0])


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the peak resident memory of this process.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    config = parse_args()
    training = config.training
    device, mesh = init_distributed(config.job)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if training.global_batch_size % (world_size * training.grad_accum_steps):
        raise SystemExit(
            f"training.global_batch_size ({training.global_batch_size}) must be divisible by "
            f"world size x grad_accum_steps ({world_size} x {training.grad_accum_steps})"
        )
    if training.seq_len > config.model.max_seq_len:
        raise SystemExit(
            f"training.seq_len ({training.seq_len}) exceeds model.max_seq_len ({config.model.max_seq_len})"
        )

    model = build_model_meta(config, mesh, device)
    optimizer, scheduler = build_optimizer(model, training, device)
    state = TrainState(model, optimizer, scheduler)

    output_dir = Path(config.job.output_dir)
    checkpoint_dir = output_dir / "checkpoints"
    if config.checkpoint.resume == "auto":
        resumed_from = checkpoint_load(state, checkpoint_dir)
        if resumed_from and rank == 0:
            print(f"resumed from {resumed_from} at step {state.step}", flush=True)

    if config.data.path:
        dataset = TokenFile(config.data.path, training.seq_len, config.model.vocab_size)
    else:
        dataset = SyntheticTokens(
            config.model.vocab_size, training.seq_len, config.data.synthetic_samples, training.seed
        )
    samples = ShuffledEpochs(dataset, training.seed)
    tokens_per_step = training.global_batch_size * training.seq_len
    metrics_file = None
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(output_dir / "metrics.jsonl", "a")

    model.train()
    for step in range(state.step, training.steps):
        started = time.perf_counter()
        batches = micro_batches(samples, step, training.global_batch_size, training.grad_accum_steps, rank, world_size)
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(model, optimizer, scheduler, batches, training.max_norm, device)
        elapsed = time.perf_counter() - started
        state.step = step + 1
        if metrics_file is not None:
            record = {
                "step": state.step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_step / elapsed,
                "peak_mem_mib": peak_memory_mib(device),
            }
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if state.step % config.job.log_every == 0 or state.step == training.steps:
                print(
                    f"step {state.step:>6} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} "
                    f"| {record['tokens_per_s']:,.0f} tok/s | peak {record['peak_mem_mib']:,.0f} MiB",
                    flush=True,
                )
        if state.step % config.checkpoint.interval == 0 or state.step == training.steps:
            checkpoint_save(state, checkpoint_dir, config.checkpoint.keep_last)

    if metrics_file is not None:
        metrics_file.close()
    # Without this barrier a rank can tear down gloo/NCCL while a peer is still in a collective.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
