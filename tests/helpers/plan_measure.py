"""Measure what `fsdp2gen plan` estimates, in a real FSDP2 run of a generated project (torchrun, gloo on CPU).

    python -m torch.distributed.run --standalone --nproc-per-node N \
        tests/helpers/plan_measure.py OUT.json PROJECT CONFIG [CONFIG ...] [-- PROJECT CONFIG [CONFIG ...] ...]

Builds the model and optimizer with the project's own train.py (meta device, fully_shard per block
then the root, to_empty, init_weights, AdamW), runs its train_step on one micro-batch, and writes per
rank: the bytes of the local parameter, gradient and AdamW state shards, and the peak of the tensors
autograd saved for backward (unique storages, parameters and buffers excluded).

With tensor parallelism (a project generated with --tp) the parameters are DTensors on the (dp, tp) mesh
and many saved tensors are DTensors too: each counts by its local tensor, what this rank holds. The ranks
of a tp group read the same samples.

Then it runs one optimizer step of the project's own `train_step` over grad_accum_steps micro-batches, with
the config's training.grad_sync, under `LiveTensorBytes` (every tensor storage allocated meanwhile, until it
is freed), and writes: the bytes held between micro-batches (at the start of the last one's forward: the
gradients, sharded or not), and the peak of forward and backward (before optimizer.step; on CPU the project
uses foreach AdamW, whose temporaries of the size of the shards the plan leaves out: CUDA uses fused AdamW).

Each CONFIG is measured in turn in the same launch (one torchrun, torch imported once: a launch of 4 ranks costs
~10 CPU-seconds before it measures anything), each with a model and an optimizer of its own, in the project named
before it (projects generated with other answers, e.g. another precision: each project's modules are imported from
its own folder, the previous project's set aside first, as they have the same names). The process group is joined
once; the mesh is laid out again when a config's parallel keys differ from the previous config's. OUT.json holds
one entry per CONFIG, in order.
"""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's memory: a DTensor's local shard, a pending collective's result."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if isinstance(tensor, AsyncCollectiveTensor):
        tensor = tensor.wait()
    return tensor


def local_bytes(tensor: torch.Tensor) -> int:
    return local(tensor).numel() * local(tensor).element_size()


def storage_address(tensor: object) -> int | None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without a real storage
        return None


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated while the mode is on and not yet freed: `now` and `peak`.

    CPU has no allocator statistics (torch.cuda.max_memory_allocated's counterpart): every op's outputs are
    counted once per storage, views and in-place results (outputs sharing an input's storage) not at all,
    and a weakref finalizer subtracts a storage when it is freed. What C++ allocates without an op (gloo's
    own buffers) is not seen; FSDP2's all-gather outputs and reduce-scatter inputs are ops, and are.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, int] = {}

    def _free(self, address: int) -> None:
        self.now -= self._live.pop(address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {storage_address(t) for t in tree_leaves((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            address = storage_address(tensor)
            if address is None or address in inputs or address in self._live:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes():
                self._live[address] = storage.nbytes()
                weakref.finalize(storage, self._free, address)
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
        return out


def measure_train_step(state, config, batches) -> dict[str, int]:
    """Live bytes during one generated train_step over `batches`: between micro-batches and at the peak."""
    from train import train_step

    model, optimizer = state.model, state.optimizer
    live = LiveTensorBytes()
    marks: dict[str, int] = {}
    forwards = 0

    def before_forward(module: torch.nn.Module, args: tuple) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == len(batches):  # the last micro-batch: what the earlier ones left behind
            marks["held_between_micro_batches"] = live.now

    real_step = optimizer.step

    def step(*args, **kwargs):
        marks["peak_forward_backward"] = live.peak
        return real_step(*args, **kwargs)

    hook = model.register_forward_pre_hook(before_forward, prepend=True)  # before FSDP2 gathers the root
    optimizer.step = step
    optimizer.zero_grad(set_to_none=True)  # as every train_step leaves them
    with live:
        train_step(state, batches, config)
    hook.remove()
    optimizer.step = real_step
    return marks


def measure_config(config, mesh, device) -> dict:
    """This rank's measurements of `config`: a model and optimizer of its own, one step, then one train_step."""
    from train import MicroBatch, TrainState, build_model_meta, build_optimizer, train_step

    training = config.training
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model_meta(config, mesh, device)
    optimizer, scheduler = build_optimizer(model, training, device)
    state = TrainState(model, optimizer, scheduler, training.global_batch_size, device, "measure")
    tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    micro_batch = training.global_batch_size // (world_size // tp * training.grad_accum_steps)
    generator = torch.Generator().manual_seed(rank // tp)  # one tp group, one micro-batch
    tokens = torch.randint(0, config.model.vocab_size, (micro_batch, training.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    saved: dict[int, int] = {}  # storage address -> bytes, so that views of one tensor count once

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Parameters (FSDP2's gathered ones while their block runs) and buffers are not activations.
        held = {local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    gradients: list[int] = []

    def count_gradients(*_: object) -> None:
        # Before the step (train_step drops the gradients after it): the reduce-scattered gradient shards.
        gradients.append(sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None))

    optimizer.register_step_pre_hook(count_gradients)
    # The project's own forward, loss (with tp: loss_parallel over vocabulary-split logits) and backward.
    # Everything saved stays alive until backward starts, so the sum of what was saved is the peak.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        train_step(state, [MicroBatch(inputs, targets)], config)
    activations = sum(saved.values())

    params = list(model.parameters())
    measured = {
        "rank": rank,
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": gradients[0],
        "optimizer_state": sum(
            local_bytes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        ),
        "parameter_count": sum(p.numel() for p in params),
        # Each parameter's shard on this rank, by name (tensor-parallel split, then FSDP's dim-0 chunk).
        "local_shapes": {name: list(local(p).shape) for name, p in model.named_parameters()},
        "activations": activations,
        "micro_batch": micro_batch,
        "tp": tp,
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
    }
    tokens = torch.randint(0, config.model.vocab_size, (training.grad_accum_steps, micro_batch, training.seq_len + 1),
                           generator=generator)  # fmt: skip
    batches = [MicroBatch(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    measured |= measure_train_step(state, config, batches)
    measured["grad_accum_steps"], measured["grad_sync"] = training.grad_accum_steps, training.grad_sync
    return measured


def groups(arguments: list[str]) -> list[tuple[Path, list[str]]]:
    """PROJECT CONFIG [CONFIG ...] [-- PROJECT CONFIG ...] -> [(project, configs), ...]."""
    result, current = [], []
    for argument in [*arguments, "--"]:
        if argument != "--":
            current.append(argument)
            continue
        assert len(current) >= 2, f"a project without configs: {current}"
        result.append((Path(current[0]).resolve(), current[1:]))
        current = []
    return result


def use_project(project: Path, previous: Path | None) -> None:
    """Import `project`'s modules from now on: those of `previous` (same names: train, config, ...) forgotten."""
    if previous is not None:
        for name, module in list(sys.modules.items()):
            if Path(getattr(module, "__file__", None) or "/").resolve().is_relative_to(previous):
                del sys.modules[name]
        sys.path.remove(str(previous))
    sys.path.insert(0, str(project))


def main() -> None:
    gc.freeze()  # the imports outlive the probe: keep them out of the collector's full passes
    out, previous, device, mesh, parallel = Path(sys.argv[1]), None, None, None, None
    runs = []
    for project, config_paths in groups(sys.argv[2:]):
        use_project(project, previous)
        previous = project
        from config import parse_args
        from layout import ParallelLayout
        from train import init_distributed

        for path in config_paths:
            config = parse_args(["--config", path, "--job.device", "cpu"])
            if mesh is None:
                device, mesh = init_distributed(config)
            elif config.parallel != parallel:  # another layout: the group is joined, lay out its mesh
                mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
            parallel = config.parallel
            measured = measure_config(config, mesh, device)
            gc.collect()  # the config's model and optimizer, before the next one's
            gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, measured)
            runs.append({"world_size": dist.get_world_size(), "ranks": gathered})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
    # The worker's models are freed once it returns; train.py's close_process_group collects them before
    # tearing the group down (gloo now and then aborts at exit when tensors outlive their group).
    from train import close_process_group

    close_process_group()
