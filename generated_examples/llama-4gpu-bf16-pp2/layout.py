"""How the ranks are laid out: the one place that turns config.parallel and the world size into a mesh.

Every rank has a coordinate on each parallelism dimension, in this order (torchtitan's ParallelDims):

    pp  x  dp_replicate  x  dp_shard

dp_shard groups the ranks a parameter is sharded over (FSDP); dp_replicate > 1 makes it HSDP: dp_replicate copies of
those groups (typically one per node), so parameters are all-gathered inside a group only, and gradients are
reduce-scattered in the group, then all-reduced across groups. fsdp_mesh() is the mesh fully_shard uses. A dimension
of size 1 is left out of the mesh; the dimensions this project was not generated with are not here at all
(`fsdp2gen update` with --tp, --cp, --pp or --moe adds them).

- pp (pipeline stages) splits the model's blocks into pp x pp_stages_per_rank stages (pipeline.py); each pp
  coordinate holds its stages, and the ranks of one pipeline read the same samples (the first stage needs the
  inputs, the last the targets). Only the last stage's ranks compute the loss (holds_loss()).

preflight.py calls check() (each mistake is one LayoutError whose message is the line it prints); train.py calls
build_mesh() and asks data_rank() which samples this rank reads. `fsdp2gen plan` loads this file too (rendered with
every dimension), so it imports no torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The mesh's dimensions, outermost first; dp_shard is always in the mesh (fully_shard needs one).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard")
# Pipeline schedules (parallel.pp_schedule, torch.distributed.pipelining's names) that run several stages per rank,
# and those of them that place the stages in a V (rank_stages(); exactly 2 stages per rank).
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


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
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    # The dimensions config.parallel has, in MESH_DIMS order: the ones messages name.
    configured: tuple[str, ...] = ("dp_replicate", "dp_shard")
    # parallel.dp_shard as configured (-1: the rest), for messages.
    dp_shard_given: int = -1
    # parallel.reshard_after_forward: true, false, or the size of the groups that keep parameters sharded.
    reshard_after_forward: bool | int = True
    # Pipeline parallelism (parallel.pp_*; pipeline.py): the schedule, the stages per pp rank, the blocks per stage.
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_layers: tuple[int, ...] = ()
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
        options |= {
            "pp_schedule": getattr(parallel, "pp_schedule", "1F1B"),
            "pp_stages_per_rank": getattr(parallel, "pp_stages_per_rank", 1),
            "pp_layers": tuple(getattr(parallel, "pp_layers", ())),
        }
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
        """Which of the data_ranks slices of each batch `rank` reads (the pp stages of one pipeline read the same)."""
        return rank % self.data_ranks

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
        Its last dimension is the shard group."""
        replicate = ("dp_replicate",) if self.dp_replicate > 1 else ()
        return mesh[(*replicate, "dp_shard")]

    @property
    def shard_ranks(self) -> int:
        """How many ranks each parameter is sharded over: dp_shard."""
        return self.dp_shard

    def check(self, training: Any, model: Any, ranks_per_node: int | None = None) -> None:
        """Raise LayoutError unless the mesh covers the ranks, the model and batch split over it evenly and the
        reshard groups divide the shard group."""
        self.check_product()
        if self.pp > 1:
            self.check_pipeline(training, model)
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

    # Pipeline parallelism (parallel.pp): where the stages are, and their checks.

    def holds_loss(self, rank: int) -> bool:
        """Whether `rank` computes the loss: only the last pipeline stage's ranks do."""
        return rank // (self.world_size // self.pp) == self.loss_pp_rank

    @property
    def v_shaped(self) -> bool:
        """Whether the schedule places the stages in a V (ZBVZeroBubble, DualPipeV): pp rank r holds stages r and
        2 x pp - 1 - r, so the first rank holds the first and the last stage, and each rank's two stages meet at
        the bottom of the V (stages pp - 1 and pp, on the last rank, pass activations without a message)."""
        return self.pp_schedule in V_SCHEDULES

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stages pp rank `pp_rank` holds, first first: round-robin (stage s on rank s % pp: rank r holds r,
        r + pp, ...), or the V of the V-shaped schedules. The one place that decides it (pipeline.py builds these)."""
        n_stages = self.pp * self.pp_stages_per_rank
        if self.v_shaped:
            return [pp_rank, n_stages - 1 - pp_rank]
        return list(range(pp_rank, n_stages, self.pp))

    @property
    def loss_pp_rank(self) -> int:
        """The pp rank that holds the last stage (and computes the loss): pp - 1, or 0 under a V."""
        return 0 if self.v_shaped else self.pp - 1

    def stage_layers(self, n_layers: int) -> list[int]:
        """How many blocks each of the pp x pp_stages_per_rank stages holds, first stage first: parallel.pp_layers,
        or as even as possible (the first stages one more)."""
        return list(self.pp_layers) or self.even_layers(n_layers)

    def even_layers(self, n_layers: int) -> list[int]:
        stages = self.pp * self.pp_stages_per_rank
        return [n_layers // stages + (1 if stage < n_layers % stages else 0) for stage in range(stages)]

    def check_pipeline(self, training: Any, model: Any) -> None:
        stages = self.pp * self.pp_stages_per_rank
        self.check_pipeline_stages_per_rank()
        n_layers, layers_key = model.n_layers, "model.n_layers"
        if model.tie_embeddings:
            raise LayoutError(
                f"model.tie_embeddings shares one matrix between the first and the last of the {self.pp} pipeline "
                "stages, which pipelines cannot; use --model.tie_embeddings false, or --parallel.pp 1",
                "pp_tied",
            )
        if n_layers < stages:
            raise LayoutError(
                f"{layers_key} ({n_layers}) leaves a pipeline stage without a block: parallel.pp x "
                f"pp_stages_per_rank = {stages} stages; use fewer stages (or a deeper model)",
                "pp_layers",
            )
        if self.pp_layers and (len(self.pp_layers) != stages or sum(self.pp_layers) != n_layers):
            raise LayoutError(
                f"parallel.pp_layers = {list(self.pp_layers)} must give the blocks of each of the {stages} stages "
                f"(parallel.pp x pp_stages_per_rank), summing to {layers_key} ({n_layers}); e.g. "
                f"--parallel.pp_layers {','.join(map(str, self.even_layers(n_layers)))}",
                "pp_layers",
            )
        if min(self.stage_layers(n_layers)) < 1:
            raise LayoutError(
                f"parallel.pp_layers = {list(self.pp_layers)} leaves a pipeline stage without a block; give each "
                f"stage at least 1, e.g. --parallel.pp_layers {','.join(map(str, self.even_layers(n_layers)))}",
                "pp_layers",
            )
        self.check_pipeline_micro_batches(training.grad_accum_steps)

    def check_pipeline_stages_per_rank(self) -> None:
        schedule, per_rank = self.pp_schedule, self.pp_stages_per_rank
        if schedule in V_SCHEDULES and per_rank != 2:
            raise LayoutError(
                f"parallel.pp_schedule = {schedule} places 2 stages on each rank (a V), but "
                f"parallel.pp_stages_per_rank is {per_rank}; use --parallel.pp_stages_per_rank 2",
                "pp_schedule",
            )
        if schedule in MULTI_STAGE_SCHEDULES and per_rank < 2:
            raise LayoutError(
                f"parallel.pp_schedule = {schedule} needs at least 2 stages per rank, but "
                f"parallel.pp_stages_per_rank is {per_rank}; use --parallel.pp_stages_per_rank 2 (or "
                "--parallel.pp_schedule 1F1B)",
                "pp_schedule",
            )
        if schedule not in MULTI_STAGE_SCHEDULES and per_rank != 1:
            raise LayoutError(
                f"parallel.pp_schedule = {schedule} runs one stage per rank, but parallel.pp_stages_per_rank is "
                f"{per_rank}; use --parallel.pp_stages_per_rank 1 (or --parallel.pp_schedule Interleaved1F1B)",
                "pp_schedule",
            )

    def check_pipeline_micro_batches(self, micro: int) -> None:
        """torch's rules for the schedule's micro-batches (training.grad_accum_steps): 1F1B runs each stage's first
        micro-batch forward before any backward, so it needs as many micro-batches as pp ranks, DualPipeV as many as
        stages (it raises otherwise); the interleaved schedules run rounds of pp micro-batches."""
        pp, schedule = self.pp, self.pp_schedule
        least = {"1F1B": pp, "DualPipeV": 2 * pp}.get(schedule, 1)
        if micro < least:
            need = f"at least parallel.pp ({pp})" if schedule == "1F1B" else f"at least its {least} stages"
            fitting = least
        elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and micro % max(1, micro // pp):
            need, fitting = f"fewer than, or a multiple of, parallel.pp ({pp})", micro // pp * pp
        else:
            return
        raise LayoutError(
            f"training.grad_accum_steps ({micro}) is the pipeline's micro-batches per step; parallel.pp_schedule "
            f"{schedule} needs {need}; e.g. --training.grad_accum_steps {fitting}",
            "pp_micro_batches",
        )
