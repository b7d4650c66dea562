"""How the ranks are laid out: the one place that turns config.parallel and the world size into a mesh.

Every rank has a coordinate on each parallelism dimension, in this order (torchtitan's ParallelDims):

    dp_replicate  x  dp_shard  x  tp

dp_shard groups the ranks a parameter is sharded over (FSDP); dp_replicate > 1 makes it HSDP: dp_replicate copies of
those groups (typically one per node), so parameters are all-gathered inside a group only, and gradients are
reduce-scattered in the group, then all-reduced across groups. fsdp_mesh() is the mesh fully_shard uses. A dimension
of size 1 is left out of the mesh; the dimensions this project was not generated with are not here at all
(`fsdp2gen update` with --tp, --cp, --pp or --moe adds them).

- tp (tensor parallelism) varies fastest, so a tp group is consecutive ranks (the GPUs of one node, over their fast
  links); the ranks of a tp group compute on the same samples, each holding a slice of every layer.

preflight.py calls check() (each mistake is one LayoutError whose message is the line it prints); train.py calls
build_mesh() and asks data_rank() which samples this rank reads. `fsdp2gen plan` loads this file too (rendered with
every dimension), so it imports no torch at import time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The mesh's dimensions, outermost first; dp_shard is always in the mesh (fully_shard needs one).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A layout that cannot work on this many ranks; the message is one line naming the problem and the fix.
    `problem` names the check (the second argument of each raise below) for callers that word it their own way
    (`fsdp2gen plan` names its options)."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    # The dimensions config.parallel has, in MESH_DIMS order: the ones messages name.
    configured: tuple[str, ...] = ("dp_replicate", "dp_shard")
    # parallel.dp_shard as configured (-1: the rest), for messages.
    dp_shard_given: int = -1
    # parallel.reshard_after_forward: true, false, or the size of the groups that keep parameters sharded.
    reshard_after_forward: bool | int = True
    sizes: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", {name: getattr(self, name) for name in MESH_DIMS})

    @classmethod
    def of(cls, parallel: Any, world_size: int) -> ParallelLayout:
        """The layout of config.parallel on `world_size` ranks. One process (`python train.py`, for debugging)
        has every dimension 1. dp_shard = -1 takes the ranks the other dimensions leave (rounded down: check()
        then says that the product does not match)."""
        configured = tuple(name for name in MESH_DIMS if hasattr(parallel, name))
        options = {"reshard_after_forward": getattr(parallel, "reshard_after_forward", True)}
        if world_size == 1:
            return cls(1, configured=configured, dp_shard_given=parallel.dp_shard, **options)
        sizes = {name: getattr(parallel, name, 1) for name in MESH_DIMS}
        if sizes["dp_shard"] == -1:
            others = 1
            for name, size in sizes.items():
                others *= size if name != "dp_shard" else 1
            sizes["dp_shard"] = world_size // others
        return cls(world_size, **sizes, configured=configured, dp_shard_given=parallel.dp_shard, **options)

    @property
    def data_ranks(self) -> int:
        """The number of ranks that read different samples: one per (dp_replicate, dp_shard) coordinate."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """Which of the data_ranks slices of each batch `rank` reads. The ranks of one tp group (consecutive
        ranks) compute on the same samples."""
        return rank // (self.tp) % self.data_ranks

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh's dimensions and sizes: those of size 1 are left out, except dp_shard (fully_shard needs one)."""
        sizes: dict[str, int] = {}
        for name, size in self.sizes.items():
            if size > 1 or name == "dp_shard":
                sizes[name] = size
        return sizes

    def build_mesh(self, device_type: str) -> Any:
        """The DeviceMesh of this layout (torch.distributed must be initialised); mesh["dp_shard"], ... are its named
        sub-meshes. init_device_mesh is a collective: every rank calls this."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.mesh_sizes
        mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        return mesh

    def fsdp_mesh(self, mesh: Any) -> Any:
        """The sub-mesh of build_mesh()'s `mesh` that fully_shard shards over: (dp_replicate,) dp_shard.
        Its last dimension is the shard group; tp ranks are left out (each keeps its slice)."""
        replicate = ("dp_replicate",) if self.dp_replicate > 1 else ()
        return mesh[(*replicate, "dp_shard")]

    @property
    def shard_ranks(self) -> int:
        """How many ranks each parameter is sharded over: dp_shard."""
        return self.dp_shard

    def check(self, training: Any, model: Any, ranks_per_node: int | None = None) -> None:
        """Raise LayoutError unless the mesh covers the ranks, the model and batch split over it evenly, the
        reshard groups divide the shard group, and each tp group stays inside a node of ranks_per_node ranks."""
        self.check_product()
        self.check_nodes(ranks_per_node or self.world_size)
        if self.tp > 1:
            self.check_tensor_parallel(training, model)
        self.check_batch(training)
        self.check_reshard()

    def check_product(self) -> None:
        named = [name for name in self.configured if name != "dp_shard"]
        product = 1
        for size in self.sizes.values():
            product *= size
        if product != self.world_size:
            given = [str(self.dp_shard_given if name == "dp_shard" else self.sizes[name]) for name in self.configured]
            others = f" (and {', '.join(named[1:])}) whose product divides" if named[1:] else " that divides"
            choose = named[0] + others
            raise LayoutError(
                f"parallel.{' x '.join(self.configured)} = {' x '.join(given)} does not match the {self.world_size} "
                f"ranks; choose {choose} {self.world_size} (dp_shard = -1 takes the rest)",
                "ranks",
            )

    def check_batch(self, training: Any) -> None:
        per_step = self.data_ranks * training.grad_accum_steps
        if training.global_batch_size % per_step:
            fitting = max(per_step, training.global_batch_size // per_step * per_step)
            raise LayoutError(
                f"training.global_batch_size ({training.global_batch_size}) must be divisible by data-parallel ranks "
                f"x grad_accum_steps ({self.data_ranks} x {training.grad_accum_steps}); e.g. "
                f"--training.global_batch_size {fitting}",
                "batch",
            )

    def check_reshard(self) -> None:
        reshard, shard = self.reshard_after_forward, self.shard_ranks
        # Groups at least as large as the shard group (a run on fewer GPUs than configured) reshard fully.
        if not isinstance(reshard, bool) and reshard < shard and shard % reshard:
            raise LayoutError(
                f"parallel.reshard_after_forward = {reshard} must divide the {shard} ranks each parameter is sharded "
                "over; use true, false or a divisor (e.g. the GPUs per node)",
                "reshard",
            )

    # Tensor parallelism (parallel.tp).

    def check_nodes(self, ranks_per_node: int) -> None:
        """A tp group is tp consecutive ranks and torchrun numbers each node's ranks consecutively: the group stays on
        one node's fast links (which every tp all-gather and reduce-scatter needs) only if tp divides the ranks per
        node."""
        if self.tp > 1 and ranks_per_node < self.world_size and ranks_per_node % self.tp:
            raise LayoutError(
                f"parallel.tp = {self.tp} puts tensor-parallel groups across nodes of {ranks_per_node} ranks each; use "
                f"a tp that divides the ranks per node, e.g. --parallel.tp {math.gcd(self.tp, ranks_per_node)}",
                "tp_node",
            )

    def check_tensor_parallel(self, training: Any, model: Any) -> None:
        tp = self.tp
        # The plan the model declares (tensor_parallel.py applies it): transformers' config class for its model_type.
        config = model.hf_config.get_text_config()
        if not getattr(config, "base_model_tp_plan", None):
            name = (getattr(model.hf_config, "architectures", None) or [type(model.hf_config).__name__])[0]
            raise LayoutError(
                f"parallel.tp = {tp}: {name} declares no tensor-parallel plan (transformers' "
                f"{type(config).__name__}.base_model_tp_plan is empty); use --parallel.tp 1 (FSDP shards it over "
                "every rank)",
                "tp_plan",
            )
        # The Hugging Face model's config.json: each tp rank computes whole heads, and an equal share of the MLP.
        heads = config.num_attention_heads
        shapes = {"num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", heads)}
        shapes["intermediate_size"] = getattr(config, "intermediate_size", None) or 0
        for name, value in shapes.items():
            if value % tp:
                raise LayoutError(
                    f"{name} = {value} (the model's config.json) must be divisible by parallel.tp = {tp}, which "
                    f"splits it; e.g. --parallel.tp {math.gcd(value, tp)}",
                    "tp_shape",
                )
