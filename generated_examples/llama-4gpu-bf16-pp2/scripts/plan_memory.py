"""Simulate one training step's GPU memory per rank, on any machine: no GPU, no memory for the weights.

    python scripts/plan_memory.py --gpus 8 [--json] [--config config.toml] [--section.key VALUE ...]

Builds this project's own model from config.toml with train.py's own code (build_model_meta: meta device, tensor
parallelism, activation checkpointing, fully_shard with the mixed-precision policy, build_optimizer,
train_step over training.grad_accum_steps micro-batches with training.grad_sync) under torch's FakeTensorMode (fake
tensors on the CPU device: see simulate), in a "fake" process group of --gpus ranks (collectives do nothing). Every
tensor has its shape, dtype and device, but no storage: an 8B or 70B model costs no memory here. Nothing fills the
shards (no init, no weights read): a Hugging Face model needs only its config.json in model.path. torch's
FSDPMemTracker counts what a CUDA rank would hold (rank 0's shards: FSDP2 pads every rank's to the same size)
through forward, backward and the optimizer step, and this prints its peak broken down (parameters, gradients,
optimizer state, activations, temporaries) and the reserved estimate: what the caching allocator would hold at that
peak (the figure nvidia-smi and out-of-memory errors show). `fsdp2gen plan --config config.toml` is the analytic
estimate of the same step; this is the measurement it is checked against.

What it does not see: the CUDA context and NCCL's buffers (about 0.5-2 GiB per GPU, outside the allocator),
fragmentation beyond block rounding over many steps.
With parallel.pp > 1 each pipeline rank is simulated in turn (its stage, built by pipeline.py, run by torch's own
schedule over training.grad_accum_steps micro-batches) and the worst is reported, as `fsdp2gen plan` reports it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules (train.py, model.py, ...)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp._fully_shard import _fully_shard as fully_shard_module  # noqa: E402
from torch.distributed.pipelining._utils import extract_tensor_metas  # noqa: E402
from torch.distributed.pipelining.stage import _StageMeta  # noqa: E402
from torch.distributed.tensor import _sharding_prop as sharding_prop  # noqa: E402
from torch.distributed.tensor import _utils as dtensor_utils  # noqa: E402
from torch.nn.modules.module import register_module_forward_pre_hook  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import train  # noqa: E402
from checkpoint import TrainState  # noqa: E402
from config import Config, parse_args  # noqa: E402
from layout import ParallelLayout  # noqa: E402

GIB = 2**30
# The tracker's categories (FSDPMemTracker's _FSDPRefType values), grouped as this script reports them.
CATEGORIES = {
    "parameters": ("Sharded Param", "Unsharded Param", "All Gather", "Buffer"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer_state": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
}
# The CUDA caching allocator rounds every block: requests up to 1 MiB to 512 bytes (carved from 2 MiB segments),
# larger ones to 2 MiB (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kSmallSize, kRoundLarge).
SMALL, SMALL_ROUND, LARGE_ROUND = 2**20, 512, 2**21


def reserved_bytes(nbytes: int) -> int:
    """What the caching allocator reserves for one tensor of `nbytes`."""
    round_to = SMALL_ROUND if nbytes <= SMALL else LARGE_ROUND
    return -(-max(nbytes, 1) // round_to) * round_to


def name(reftype: Any) -> str:
    """A tracker category's name ("Sharded Param"), or "Total"."""
    return getattr(reftype, "value", reftype)


class Tracker(FSDPMemTracker):
    """FSDPMemTracker keeping the peak of what sits on the GPU (everything it tracks), its breakdown, and the blocks
    the caching allocator would reserve for the tensors live at that peak."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gpu_peak, self.gpu_snapshot, self.reserved_at_peak, self.peak_at = 0, {}, 0, ""

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Not FSDPMemTracker's own: on every op it walks every module tracked so far (time quadratic in the blocks:
        # most of a 70B step's) for per-module peaks that this script never reads.
        for snapshot in self._curr_mem_snap.values():
            on_gpu = sum(size for key, size in snapshot.items() if key != "Total")
            if on_gpu > self.gpu_peak:
                self.gpu_peak, self.gpu_snapshot = on_gpu, {name(key): size for key, size in snapshot.items()}
                inside = max(self._mod_tracker.parents, key=len)  # the innermost module running ("Global": none)
                where = "the loss, the root or the optimizer" if inside == "Global" else inside
                self.peak_at = f"{'backward' if self._mod_tracker.is_bw else 'forward'}, in {where}"
                self.reserved_at_peak = sum(reserved_bytes(winfo.mem_consumed) for winfo, _ in self._WINFO.values())


def real_mesh_arithmetic() -> None:
    """A DeviceMesh computes this rank's coordinates from a real tensor of ranks (nonzero(), a data-dependent
    shape), and DTensor a strided shard's offsets (sharded_init.py) from a real index tensor: fake tensors cannot
    do either, so both run outside the fake mode, as does fully_shard's mesh of the groups that keep parameters
    sharded after forward (parallel.reshard_after_forward = N: a view of the ranks' tensor, fake in the fake mode).
    (torch's private functions: re-check them when torch changes; tests/test_plan_simulation.py runs this script.)"""
    init = DeviceMesh.__init__
    compute = dtensor_utils._compute_local_shape_and_global_offset
    post_forward_mesh = fully_shard_module._get_post_forward_mesh_info

    def real_init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_compute(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return compute(*args, **kwargs)

    def real_post_forward_mesh(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return post_forward_mesh(*args, **kwargs)

    DeviceMesh.__init__ = real_init
    dtensor_utils._compute_local_shape_and_global_offset = real_compute
    fully_shard_module._get_post_forward_mesh_info = real_post_forward_mesh
    # DTensor computes output shapes on fake copies of whole (unsharded) tensors, in the active fake mode if there
    # is one: the tracker would count those as memory. In a fake mode of their own, the tracker skips them.
    sharding_prop.detect_fake_mode = lambda *args: None


class ValuesReadOnTheHost(TorchDispatchMode):
    """A value the step reads on the host (a tensor's .item() or int(): with task sft, the number of the step's
    targets) reads as 1: fake tensors hold no values, and no memory depends on it. (The step reads no other: it
    makes no host syncs.)
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def simulate(config: Config, gpus: int) -> dict[str, Any]:
    """One train_step of `config` on `gpus` ranks: rank 0's peak by category, or under parallel.pp > 1 the worst
    pipeline rank's (the first rank of each pipeline rank's group, pp outermost as layout.py lays the mesh out),
    with every pipeline rank's peak in "pipeline_ranks" and its figures in "pipeline_figures"."""
    real_mesh_arithmetic()
    pp = config.parallel.pp
    ranks = []
    for pp_rank in range(pp):
        # DTensor's sharding cache (C++) keeps the output specs of the ops it has seen, their meshes with them: an
        # earlier pipeline rank's mesh compares equal to this rank's (the same layout) but names that rank's process
        # groups, which destroy_process_group removed. (torch's private function: re-check it when torch changes.)
        torch._C._clear_DTensor_sharding_propagator_cache()
        ranks.append(simulate_rank(config, gpus, pp_rank * (gpus // pp)))
    worst = max(range(pp), key=lambda pp_rank: ranks[pp_rank]["allocated"])
    pipeline = {"rank": worst * (gpus // pp), "pipeline_rank": worst, "pipeline_ranks": [r["allocated"] for r in ranks],
                "pipeline_figures": ranks}  # fmt: skip
    return ranks[worst] | pipeline


def static_stage_metadata(model: Any, config: Config, micro_batch: int) -> torch.nn.Module:
    """Give torch's pipeline stages the shapes they would exchange, and return the rank's stage (its FSDP root).

    At its first step a PipelineStage learns its input and output shapes from its neighbours over the process
    group (the previous stage sends them); the fake process group carries no messages, so they are given here, as
    PipelineStage(input_args=..., output_args=...) would take them: the first stage's input is the token ids, a later
    stage's the hidden states (batch x seq x hidden, in the dtype the previous stage's root outputs), each stage's
    output the hidden states or (the last) the logits."""
    schedule = model.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    text = config.model
    width, vocab = text.dim, text.vocab_size
    hidden = torch.float32 if config.parallel.output_dtype == "float32" else torch.bfloat16
    tokens = (micro_batch, config.training.seq_len)
    between = (*tokens, width)
    for stage in stages:
        inputs = torch.zeros(tokens, dtype=torch.long) if stage.is_first else torch.zeros(between, dtype=hidden)
        outputs = torch.zeros(*tokens, vocab, dtype=hidden) if stage.is_last else torch.zeros(between, dtype=hidden)
        inputs.requires_grad_(not stage.is_first)
        outputs.requires_grad_()
        metas = {"inputs": (inputs,), "outputs": (outputs,)}
        stage._user_meta = _StageMeta(**{key: extract_tensor_metas(value) for key, value in metas.items()})
    return stages[0].submod


def simulate_rank(config: Config, gpus: int, rank: int) -> dict[str, Any]:
    """One train_step of `config` on rank `rank` of `gpus` ranks: the tracker's peak of GPU memory, by category.

    The fake tensors sit on the CPU device: autograd needs a device guard for CUDA tensors, which a torch built
    without CUDA lacks even for fake ones. train.py's code path is CUDA's but for AdamW, switched to the fused
    implementation CUDA runs (see below).
    """
    # Fake tensors hold no values: filling them (model.py's initialize: the model's random init, a pretrained
    # model's weights read from model.path, LoRA's adapters) would only cost time, and reading files cannot be
    # faked. The shards are allocated (to_empty) as in training; only their filling is skipped. So a config.json
    # alone (no weights) simulates a pretrained hf model.
    train.initialize = lambda model, config, device: None
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=gpus)
    try:
        layout = ParallelLayout.of(config.parallel, gpus)
        device = torch.device("cpu")
        mesh = layout.build_mesh(device.type)
        training = config.training
        micro_batch = training.global_batch_size // (layout.data_ranks * training.grad_accum_steps)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = train.build_model_meta(config, mesh, device)
            optimizer, scheduler = train.build_optimizer(model, training, device)
            # On GPUs build_optimizer picks the fused AdamW (parameters on the GPU), which makes no temporaries the
            # size of the shards as foreach AdamW (this CPU's choice) does.
            for group in optimizer.param_groups:
                group.update(fused=True, foreach=False)
            state = TrainState(model, optimizer, scheduler, training.global_batch_size, device, "plan_memory")
            shape = (micro_batch, training.seq_len)
            # Plain causal attention (no document ids): on GPUs FlexAttention's document masks add no activations.
            batches = [train.MicroBatch(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long))
                       for _ in range(training.grad_accum_steps)]  # fmt: skip
            # A step of training's steady state: AdamW's state exists (it is created at the first step), and the
            # gradients were freed by the previous step's zero_grad.
            # (Frozen parameters, e.g. the pretrained weights under LoRA's adapters, never have gradients.)
            for param in model.parameters():
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # Under pp > 1 the model is this rank's PipelineModel; the tracker follows its stage's FSDP root.
            tracked = static_stage_metadata(model, config, micro_batch) if config.parallel.pp > 1 else model
            tracker = Tracker(tracked, optimizer)

            # FSDPMemTracker refuses a second forward of the root (grad accumulation) unless its per-module
            # statistics are cleared first; the peak this script keeps is its own (Tracker.gpu_peak).
            # (A global hook: it runs before the root's own, FSDP's, pre-forward hook.)
            def reset_at_root(module: torch.nn.Module, inputs: Any) -> None:
                if module is tracked:
                    tracker.reset_mod_stats()

            hook = register_module_forward_pre_hook(reset_at_root)
            with tracker, ValuesReadOnTheHost():
                train.train_step(state, batches, config)
            hook.remove()
    finally:
        # A no-op in the fake process group; kept so the script reads like every other teardown (and fsdp2gen
        # check's FSDP010 holds everywhere in a project).
        dist.barrier()
        dist.destroy_process_group()
    peak = tracker.gpu_snapshot
    breakdown = {category: sum(peak.get(key, 0) for key in keys) for category, keys in CATEGORIES.items()}
    return {"gpus": gpus, "micro_batch": micro_batch, **breakdown, "allocated": tracker.gpu_peak,
            "reserved": tracker.reserved_at_peak, "peak_at": tracker.peak_at}  # fmt: skip


def main() -> None:
    gc.freeze()  # torch's import-time objects live as long as the process: the collector's full passes skip them
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--gpus", type=int, required=True, help="the number of GPUs (world size) to simulate")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, rest = parser.parse_known_args()
    if args.gpus < 1:
        parser.exit(2, f"{parser.prog}: error: --gpus must be at least 1, got {args.gpus}; give --gpus 1 or more\n")
    config = parse_args(rest)
    layout = ParallelLayout.of(config.parallel, args.gpus)
    if layout.pp > 1 and layout.pp_stages_per_rank > 1:
        # FSDPMemTracker follows one FSDP root, and a rank's several stages are several.
        v = layout.pp_stages_per_rank
        problem = f"parallel.pp = {layout.pp} with pp_stages_per_rank {v} is not simulated (one stage per rank is)"
        fix = "--parallel.pp_stages_per_rank 1 --parallel.pp_schedule 1F1B"
        parser.exit(2, f"{parser.prog}: error: {problem}; simulate with {fix} (`fsdp2gen plan` plans it)\n")
    result = simulate(config, args.gpus)
    if args.json:
        print(json.dumps(result))
        return
    print(f"simulated: {args.gpus} GPU(s), micro-batch {result['micro_batch']} x {config.training.seq_len} tokens, "
          f"{config.training.grad_accum_steps} micro-batch(es) per step; peak per GPU "
          f"(rank {result.get('rank', 0)}):")  # fmt: skip
    for key in CATEGORIES:
        print(f"  {key:<24}{result[key] / GIB:>10.2f} GiB")
    print(f"  {'allocated (peak)':<24}{result['allocated'] / GIB:>10.2f} GiB")
    print(f"  {'peak reached in':<24}{result['peak_at']}")
    print(f"  {'reserved (estimate)':<24}{result['reserved'] / GIB:>10.2f} GiB   (what nvidia-smi and OOMs see)")
    if "pipeline_ranks" in result:
        ranks = ", ".join(f"{rank}: {size / GIB:.2f} GiB" for rank, size in enumerate(result["pipeline_ranks"]))
        print(f"  {'by pipeline rank':<24}{ranks} (the rows above: pipeline rank {result['pipeline_rank']}'s)")


if __name__ == "__main__":
    main()
