"""How the ranks are laid out: the one place that turns config.parallel and the world size into a mesh.

Every rank has a coordinate on each parallelism dimension, in this order (torchtitan's ParallelDims):

    dp_replicate  x  dp_shard

dp_shard groups the ranks a parameter is sharded over (FSDP); dp_replicate > 1 makes it HSDP: dp_replicate copies of
those groups (typically one per node), so parameters are all-gathered inside a group only, and gradients are
reduce-scattered in the group, then all-reduced across groups. fsdp_mesh() is the mesh fully_shard uses. A dimension
of size 1 is left out of the mesh; the dimensions this project was not generated with are not here at all
(`fsdp2gen update` with --tp, --cp, --pp or --moe adds them).

- ep (expert parallelism, mixture-of-experts models) borrows its ranks from dp_shard, as in torchtitan: with ep > 1
  the mesh splits dp_shard into dp_shard_mod_ep x ep (ep varies faster) and flattens the two back into "dp_shard",
  so mesh["dp_shard"] and fsdp_mesh() are unchanged. Each ep group of ranks shares out every MoE layer's experts
  (mesh["ep"]); the expert weights are then sharded over the ranks that hold the same experts (expert_fsdp_mesh()).
  The ep ranks read different samples, as any dp_shard ranks do. Tokens travel to their experts' ranks and back
  (expert_parallel.py).

preflight.py calls check() (each mistake is one LayoutError whose message is the line it prints); train.py calls
build_mesh() and asks data_rank() which samples this rank reads. `fsdp2gen plan` loads this file too (rendered with
every dimension), so it imports no torch at import time.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

# The mesh's dimensions, outermost first; dp_shard is always in the mesh (fully_shard needs one).
MESH_DIMS = ("dp_replicate", "dp_shard")


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
    ep: int = 1  # borrowed from dp_shard: not one of `sizes` (see the module docstring)
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
        sizes["ep"] = getattr(parallel, "ep", 1)  # one process (above) holds every expert itself
        return cls(world_size, **sizes, configured=configured, dp_shard_given=parallel.dp_shard, **options)

    @property
    def data_ranks(self) -> int:
        """The number of ranks that read different samples: one per (dp_replicate, dp_shard) coordinate."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """Which of the data_ranks slices of each batch `rank` reads."""
        return rank % self.data_ranks

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh's dimensions and sizes: those of size 1 are left out, except dp_shard (fully_shard needs one),
        which ep > 1 builds as dp_shard_mod_ep x ep (both kept, even of size 1: FSDP shards the experts over the
        first)."""
        sizes: dict[str, int] = {}
        for name, size in self.sizes.items():
            if name == "dp_shard" and self.ep > 1:
                sizes |= {"dp_shard_mod_ep": size // self.ep, "ep": self.ep}
                continue
            if size > 1 or name == "dp_shard":
                sizes[name] = size
        return sizes

    def build_mesh(self, device_type: str) -> Any:
        """The DeviceMesh of this layout (torch.distributed must be initialised); mesh["dp_shard"], ... are its named
        sub-meshes. init_device_mesh is a collective: every rank calls this."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.mesh_sizes
        mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        if self.ep > 1:
            # dp_shard as one dimension again, for everything but the experts (a collective, made once).
            mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh

    def fsdp_mesh(self, mesh: Any) -> Any:
        """The sub-mesh of build_mesh()'s `mesh` that fully_shard shards over: (dp_replicate,) dp_shard.
        Its last dimension is the shard group."""
        replicate = ("dp_replicate",) if self.dp_replicate > 1 else ()
        if self.ep > 1:
            return self._flattened(mesh, (*replicate, "dp_shard"))
        return mesh[(*replicate, "dp_shard")]

    def expert_fsdp_mesh(self, mesh: Any) -> Any:
        """The sub-mesh fully_shard shards the experts over when ep > 1: (dp_replicate,) dp_shard_mod_ep, the ranks
        that hold the same experts (each rank of an ep group holds others)."""
        return mesh[("dp_replicate", "dp_shard_mod_ep") if self.dp_replicate > 1 else "dp_shard_mod_ep"]

    @staticmethod
    def _flattened(mesh: Any, names: tuple[str, ...]) -> Any:
        with warnings.catch_warnings():
            # torch 2.13 asks callers to keep flattened meshes themselves, but has no other way to pair one with
            # dp_replicate for HSDP (torchtitan slices it the same way), or to get it back from the root mesh.
            warnings.filterwarnings("ignore", "Slicing a flattened dim")
            return mesh[names]

    @property
    def shard_ranks(self) -> int:
        """How many ranks each parameter is sharded over: dp_shard."""
        return self.dp_shard

    def check(self, training: Any, model: Any, ranks_per_node: int | None = None) -> None:
        """Raise LayoutError unless the mesh covers the ranks, the model and batch split over it evenly and the
        reshard groups divide the shard group."""
        self.check_product()
        self.check_expert_parallel(model)
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

    # Expert parallelism (parallel.ep).

    def check_expert_parallel(self, model: Any) -> None:
        ep, n_experts = self.ep, getattr(model, "n_experts", 0)
        if ep == 1 or self.world_size == 1:  # one process (python train.py) holds every expert itself
            return
        # A count config.json names under no known key (0): expert_parallel.py checks the experts' weights instead.
        n_experts = self.check_expert_plan(model) or ep
        if not n_experts:
            raise LayoutError(
                f"parallel.ep = {ep} needs a mixture-of-experts model, but model.n_experts is 0; use --parallel.ep 1 "
                "or a model with experts (e.g. --model.size debug-moe)",
                "ep_experts",
            )
        fitting = self.fitting_ep(n_experts)
        if self.dp_shard % ep:
            raise LayoutError(
                f"parallel.ep ({ep}) must divide parallel.dp_shard ({self.dp_shard}): expert parallelism borrows its "
                f"ranks from the shard group; e.g. --parallel.ep {fitting}",
                "ep_ranks",
            )
        if n_experts % ep:
            raise LayoutError(
                f"the model's {n_experts} experts (its config.json) must be divisible by parallel.ep ({ep}), which "
                f"shares them out equally; e.g. --parallel.ep {fitting}",
                "ep_experts",
            )

    def check_expert_plan(self, model: Any) -> int:
        """The number of experts of the Hugging Face model (0: none found in config.json), after checking that it
        declares the expert-parallel plan expert_parallel.py applies (its config class's base_model_ep_plan)."""
        config = model.hf_config.get_text_config()
        if not getattr(config, "base_model_ep_plan", None):
            name = (getattr(model.hf_config, "architectures", None) or [type(model.hf_config).__name__])[0]
            raise LayoutError(
                f"parallel.ep = {self.ep}: {name} declares no expert-parallel plan (transformers' "
                f"{type(config).__name__}.base_model_ep_plan is empty: a dense model has no experts to share out); use "
                "--parallel.ep 1",
                "ep_plan",
            )
        # num_experts: transformers' MoE configs map it to their own name (Mixtral's num_local_experts).
        counts = [getattr(config, key, None) for key in ("num_experts", "n_routed_experts", "num_local_experts")]
        return next((count for count in counts if isinstance(count, int) and count > 0), 0)

    def fitting_ep(self, n_experts: int) -> int:
        """The largest expert-parallel degree not above parallel.ep that check_expert_parallel accepts: one that
        divides both dp_shard (the ranks it borrows) and n_experts (each rank holds whole experts)."""
        return max(d for d in range(1, self.ep + 1) if self.dp_shard % d == 0 and n_experts % d == 0)
