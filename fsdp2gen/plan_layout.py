"""The run the planner plans (PlanRequest) and its mesh arithmetic: how the ranks split the model and the batch,
exactly as the generated project's layout.py (loaded from the template) lays them out."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import jinja2

from fsdp2gen.plan_shapes import MIB, expert_shard_numel, in_block, is_expert, shard_numel
from fsdp2gen.questions import template_dir
from fsdp2gen.sizes import (
    LlamaShape,
)

# activation_checkpointing's choices (copier.yml), from the least recomputation to the most.
AC_MODES = ("none", "selective", "layer", "full")

# training.grad_sync of the generated config: when gradients are reduce-scattered under accumulation.
GRAD_SYNC_MODES = ("every_micro_batch", "last_micro_batch")

TEMPLATE_TRAINING = {"global_batch_size": 32, "seq_len": 256, "grad_accum_steps": 1}

TEMPLATE_GRAD_SYNC = "every_micro_batch"

# training.loss_chunks of the generated config: the loss's logits are computed this many sequence chunks at a time.
TEMPLATE_LOSS_CHUNKS = 8


class PlanError(ValueError):
    """Input the user can fix; the CLI reports it as one line with exit code 2."""


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # total memory as nvidia-smi reports it


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("h100-80gb", 81559 * MIB),
        Gpu("h200-141gb", 143771 * MIB),
        Gpu("a100-80gb", 81920 * MIB),
        Gpu("a100-40gb", 40960 * MIB),
        Gpu("l40s-48gb", 46068 * MIB),
        Gpu("a10-24gb", 23028 * MIB),
        Gpu("rtx4090-24gb", 24564 * MIB),
        Gpu("v100-32gb", 32768 * MIB),
        Gpu("v100-16gb", 16384 * MIB),
    )
}

# The generated project's layout.py: the one place that lays ranks out on the mesh. A Jinja template (a project holds
# only the dimensions its answers chose), rendered here with every dimension and run as a module (it imports no torch
# at import time), so that plan splits the model and the batch exactly as the project's train.py does.
LAYOUT_FILE = Path("project") / "layout.py.jinja"
EVERY_DIMENSION = {"pp": 2, "tp": 2, "cp": 2, "moe": True, "expert_parallel": True}


def render_layout(**answers: Any) -> str:
    """The source of the layout.py a project with these answers (pp, tp, cp, moe; a llama model unless
    transformers_model is given) holds."""
    answers.setdefault("transformers_model", False)
    answers.setdefault("expert_parallel", answers.get("moe", False))  # copier.yml derives it the same way for llama
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    environment.undefined = jinja2.StrictUndefined  # an answer the template reads but was not given fails here
    return environment.from_string((template_dir() / LAYOUT_FILE).read_text(encoding="utf-8")).render(answers)


@cache
def layout_module() -> ModuleType:
    """The template's layout.py, rendered with every dimension, as a module (ParallelLayout, LayoutError); made
    once per process."""
    module = ModuleType("fsdp2gen_project_layout")
    sys.modules[module.__name__] = module  # dataclasses look the module up while they build the class
    code = compile(render_layout(**EVERY_DIMENSION), str(template_dir() / LAYOUT_FILE), "exec")
    exec(code, module.__dict__)  # the template's own file, shipped with fsdp2gen
    return module


def parallel_layout(
    world_size: int, tp: int, cp: int = 1, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1
) -> Any:
    """The ParallelLayout of a project with parallel.tp = `tp` (and parallel.cp = `cp`, parallel.pp = `pp`) on
    `world_size` ranks, `dp_replicate` copies (HSDP) of FSDP over `dp_shard` ranks (-1: the rest). A project without
    context (pipeline) parallelism has no parallel.cp (parallel.pp): only cp > 1 (pp > 1) names it."""
    extra = ({"cp": cp} if cp > 1 else {}) | ({"pp": pp} if pp > 1 else {})
    parallel = SimpleNamespace(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, **extra)
    return layout_module().ParallelLayout.of(parallel, world_size)


@dataclass(frozen=True)
class PlanRequest:
    model: LlamaShape
    label: str  # "llama 8b" or the config file
    gpus: int = 8
    nodes: int = 1
    precision: str = "bf16"
    offload: bool = False
    ac: str = "none"
    tp: int = 1
    cp: int = 1  # context parallelism: each rank of a cp group holds seq_len / cp tokens of every sample
    ep: int = 1  # expert parallelism: each rank holds n_experts / ep experts, ranks borrowed from dp_shard
    seq_len: int = 8192
    micro_batch: int | None = None  # samples per GPU per forward; None: from global_batch_size
    global_batch_size: int | None = None
    grad_accum_steps: int | None = 1  # None: not known (--size), assumed > 1 for grad_sync
    grad_sync: str = TEMPLATE_GRAD_SYNC
    gpu: str = "h100-80gb"
    task: str = "pretrain"  # the project's task: "sft" masks the prompt's targets, the same memory
    loss_chunks: int = TEMPLATE_LOSS_CHUNKS
    # Pipeline parallelism (plan_pp.py): pp ranks of pp x pp_stages_per_rank stages; under pp > 1 grad_accum_steps
    # is the schedule's number of micro-batches. pp_layers: parallel.pp_layers, each stage's blocks (() = even).
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_layers: tuple[int, ...] = ()
    # HSDP (parallel.dp_replicate, dp_shard): dp_replicate copies of the model, each sharded over dp_shard ranks
    # (-1: the rest). The state per GPU is that of dp_shard x cp ranks, not of all of them.
    dp_replicate: int = 1
    dp_shard: int = -1
    ac_every: int = 2  # parallel.activation_checkpoint_every: "layer" AC checkpoints the blocks whose index it divides
    prefetch_blocks: int = 1  # parallel.prefetch_blocks: blocks all-gathered ahead (0: FSDP2's implicit one)
    # parallel.reshard_after_forward: true frees a block's gathered parameters after its forward; false keeps them
    # until its backward; N keeps them sharded over groups of N ranks (N at least the shard group: as true).
    reshard_after_forward: bool | int = True
    # parallel.reduce_dtype: the dtype gradients are reduce-scattered (and, under last_micro_batch, accumulated
    # unsharded) in; the sharded gradients are fp32 either way.
    reduce_dtype: str = "float32"
    # The config's keys off their defaults that change memory in a way plan does not model (plan_config.py's
    # CONFIG_KEYS), as "key = value: why"; the report lists them under the plan.
    unmodelled: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def data_ranks(self) -> int:
        """The ranks that read different samples: layout.py's data_ranks, dp_replicate x dp_shard."""
        return self.layout.data_ranks

    @property
    def layout(self) -> Any:
        """The project's ParallelLayout of this request (layout.py's)."""
        return parallel_layout(self.world_size, self.tp, self.cp, self.pp, self.dp_replicate, self.dp_shard)

    @property
    def fsdp_ranks(self) -> int:
        """The ranks a parameter is sharded over: dp_shard x cp (FSDP over the flattened mesh, as torchtitan), so
        for a fixed number of GPUs and tp the state per GPU does not change with cp."""
        return self.layout.dp_shard * self.cp

    @property
    def local_seq_len(self) -> int:
        """The tokens of each sample one rank holds: seq_len / cp (2 x cp load-balanced chunks, 2 per rank)."""
        return self.seq_len // self.cp

    @property
    def batch(self) -> int:
        if self.micro_batch is not None:
            return self.micro_batch
        if self.global_batch_size is not None:
            return self.global_batch_size // (self.data_ranks * (self.grad_accum_steps or 1))
        return 1

    @property
    def reduce_bytes(self) -> int:
        return 4 if self.reduce_dtype == "float32" else 2

    @property
    def defers_gradients(self) -> bool:
        """Every rank holds unsharded gradients across micro-batches: last_micro_batch while accumulating."""
        accumulating = self.grad_accum_steps is None or self.grad_accum_steps > 1
        return self.grad_sync == "last_micro_batch" and accumulating


def request_shard_numel(request: PlanRequest, name: str, shape: tuple[int, ...]) -> int:
    """Elements of rank 0's shard of parameter `name` under the request's layout: experts by expert_shard_numel,
    the rest over all FSDP ranks."""
    if is_expert(name):
        return expert_shard_numel(shape, request.fsdp_ranks, request.ep)
    return shard_numel(shape, request.fsdp_ranks)


def gathered_numel(request: PlanRequest, name: str, shape: tuple[int, ...]) -> int:
    """Elements of `name` once FSDP all-gathers it: the whole tensor, or for an expert weight this rank's
    n_experts / ep experts."""
    return math.prod(shape) // request.ep if is_expert(name) else math.prod(shape)


def gathered_blocks(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]]) -> list[int]:
    """Elements of each block once gathered (a mixture-of-experts block's experts: this rank's n_experts / ep)."""
    blocks: dict[str, int] = {}
    for name, shape in shapes:
        if in_block(name):
            index = name.removeprefix("model.").split(".")[1]
            blocks[index] = blocks.get(index, 0) + gathered_numel(request, name, shape)
    return list(blocks.values())


def largest_block(request: PlanRequest, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """Elements of the largest block once gathered (a dense model's blocks are all alike)."""
    return max(gathered_blocks(request, shapes), default=0)


def expert_layout(request: PlanRequest, ep: int) -> Any:
    """The ParallelLayout whose check_expert_parallel (as a project's preflight runs it) judges `ep` experts
    groups borrowed from request's dp_shard ranks (not from cp's: layout.py's docstring says why)."""
    return layout_module().ParallelLayout(request.world_size, dp_shard=request.layout.dp_shard, ep=ep)


def ep_takes(request: PlanRequest, ep: int) -> bool:
    """Whether a project's layout.py takes parallel.ep = `ep` for request's model and GPUs."""
    try:
        expert_layout(request, ep).check_expert_parallel(request.model)
    except layout_module().LayoutError:
        return False
    return True


def cp_takes(seq_len: int, cp: int, tp: int, loss_chunks: int) -> bool:
    """Whether a project's layout.py (check_context_parallel, as its preflight runs it) takes a sequence of seq_len
    tokens split over cp x tp ranks with training.loss_chunks."""
    if cp == 1:
        return True
    layout = layout_module().ParallelLayout(cp * tp, cp=cp, tp=tp)
    try:
        layout.check_context_parallel(SimpleNamespace(seq_len=seq_len, loss_chunks=loss_chunks))
    except layout_module().LayoutError:
        return False
    return True
