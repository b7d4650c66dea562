"""How the ranks are laid out: the one place that turns config.parallel and the world size into a mesh.

Every rank has a coordinate on each parallelism dimension, in this order (torchtitan's ParallelDims):

    pp  x  dp_replicate  x  dp_shard  x  cp  x  tp

tp varies fastest, so a tp group is consecutive ranks (the GPUs of one node, over their fast links). dp_shard
groups the ranks a parameter is sharded over (FSDP); dp_replicate > 1 makes it HSDP: dp_replicate copies of those
groups (typically one per node), so parameters are all-gathered inside a group only, and gradients are
reduce-scattered in the group, then all-reduced across groups. cp (context parallelism) splits every sequence over
cp ranks, which read the same samples; since each of them computes gradients on different tokens, FSDP shards
(and averages gradients) over dp_shard x cp, as torchtitan does: fsdp_mesh() is the mesh fully_shard uses. A
dimension the project's config does not have (parallel.tp and parallel.cp only exist in projects generated with
--tp, --cp) has size 1, and so do the slots for the dimensions not built yet:

- pp (pipeline stages: parallel.pp in projects generated with --pp) splits the model's blocks into
  pp x pp_stages_per_rank stages (pipeline.py); each pp coordinate holds its stages, and the ranks of one pipeline
  read the same samples (the first stage needs the inputs, the last the targets). Only the last stage's ranks
  compute the loss (holds_loss()).
- ep (expert parallelism, mixture-of-experts models: parallel.ep in projects generated with --moe) borrows its
  ranks from dp_shard, as in torchtitan: with ep > 1 the mesh splits dp_shard into dp_shard_mod_ep x ep (ep
  varies faster) and flattens the two back into "dp_shard", so mesh["dp_shard"] and fsdp_mesh() are unchanged.
  Each ep group of ranks shares out every MoE layer's experts (mesh["ep"]); the expert weights are then sharded
  over the ranks that hold the same experts (expert_fsdp_mesh()). The ep ranks read different samples, as any
  dp_shard ranks do. Tokens travel to their experts' ranks and back (expert_parallel.py).

preflight.py calls check() (each mistake is one LayoutError whose message is the line it prints); train.py calls
build_mesh() and asks data_rank() which samples this rank reads. `fsdp2gen plan` loads this file too, so it
imports no torch at import time.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

# The mesh's dimensions, outermost first; dp_shard is always in the mesh (fully_shard needs one).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Dimensions whose ranks compute on the same samples (they split the model or the sequence, not the batch).
SAME_DATA_DIMS = ("cp", "tp")
# Pipeline schedules (parallel.pp_schedule, torch.distributed.pipelining's names) that run several stages per rank,
# and those of them that place the stages in a V (rank_stages(); exactly 2 stages per rank).
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


class LayoutError(ValueError):
    """A layout that cannot work on this many ranks; the message is one line naming the problem and the fix.
    `problem` names the check ("ranks", "tp_shape", "tp_seq_len", "cp_seq_len", "cp_loss_chunks", "batch",
    "reshard", "ep_ranks", "ep_experts", "pp_schedule", "pp_tied", "pp_layers", "pp_micro_batches") for
    callers that word it their own way (`fsdp2gen plan` names its options)."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # borrowed from dp_shard: not one of `sizes` (see the module docstring)
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
        reshard = getattr(parallel, "reshard_after_forward", True)
        pipeline = {
            "pp_schedule": getattr(parallel, "pp_schedule", "1F1B"),
            "pp_stages_per_rank": getattr(parallel, "pp_stages_per_rank", 1),
            "pp_layers": tuple(getattr(parallel, "pp_layers", ())),
        }
        if world_size == 1:
            return cls(
                1, configured=configured, dp_shard_given=parallel.dp_shard, reshard_after_forward=reshard, **pipeline
            )
        sizes = {name: getattr(parallel, name, 1) for name in MESH_DIMS}
        if sizes["dp_shard"] == -1:
            others = 1
            for name, size in sizes.items():
                others *= size if name != "dp_shard" else 1
            sizes["dp_shard"] = world_size // others
        return cls(
            world_size,
            **sizes,
            ep=getattr(parallel, "ep", 1),
            configured=configured,
            dp_shard_given=parallel.dp_shard,
            reshard_after_forward=reshard,
            **pipeline,
        )

    @property
    def data_ranks(self) -> int:
        """The number of ranks that read different samples: one per (dp_replicate, dp_shard) coordinate."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """Which of the data_ranks slices of each batch `rank` reads. The ranks of one cp x tp group (consecutive
        ranks) compute on the same samples, and so do the pp stages of one pipeline."""
        same_data = 1
        for name in SAME_DATA_DIMS:
            same_data *= self.sizes[name]
        return rank // same_data % self.data_ranks

    def holds_loss(self, rank: int) -> bool:
        """Whether `rank` computes the loss: every rank, except that with pipeline stages only the last stage's
        ranks do."""
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

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh's dimensions and sizes: those of size 1 are left out, except dp_shard, which ep > 1 builds as
        dp_shard_mod_ep x ep (both kept, even of size 1: FSDP shards the experts over the first)."""
        sizes: dict[str, int] = {}
        for name, size in self.sizes.items():
            if name == "dp_shard" and self.ep > 1:
                sizes |= {"dp_shard_mod_ep": size // self.ep, "ep": self.ep}
            elif size > 1 or name == "dp_shard":
                sizes[name] = size
        return sizes

    def build_mesh(self, device_type: str) -> Any:
        """The DeviceMesh of this layout (torch.distributed must be initialised); mesh["tp"], mesh["dp_shard"], ...
        are its named sub-meshes. init_device_mesh is a collective: every rank calls this."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.mesh_sizes
        mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        if self.ep > 1:
            # dp_shard as one dimension again, for everything but the experts (a collective, made once).
            mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        if self.cp > 1:
            # One dimension for FSDP's shard groups: the ranks of a dp_shard x cp block (a collective, made once).
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh

    def fsdp_mesh(self, mesh: Any) -> Any:
        """The sub-mesh of build_mesh()'s `mesh` that fully_shard shards over: (dp_replicate,) dp_shard, with cp
        folded into dp_shard. Its last dimension is the shard group; tp ranks are left out (each keeps its slice)."""
        replicate = ("dp_replicate",) if self.dp_replicate > 1 else ()
        if self.ep > 1:
            return self._flattened(mesh, (*replicate, "dp_shard"))
        if self.cp == 1:
            return mesh[(*replicate, "dp_shard")]
        if not replicate:
            return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # build_mesh made it: this returns it
        return self._flattened(mesh, ("dp_replicate", "dp_shard_cp"))

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
        """How many ranks each parameter is sharded over: dp_shard x cp."""
        return self.dp_shard * self.cp

    def check(self, training: Any, model: Any, ranks_per_node: int | None = None) -> None:
        """Raise LayoutError unless the mesh covers the ranks, the model and batch split over it evenly, the
        reshard groups divide the shard group, and each tp group stays inside a node of ranks_per_node ranks."""
        self.check_product()
        self.check_nodes(ranks_per_node or self.world_size)
        if self.tp > 1:
            self.check_tensor_parallel(training, model)
        if self.cp > 1:
            self.check_context_parallel(training)
        self.check_expert_parallel(model)
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

    def check_nodes(self, ranks_per_node: int) -> None:
        """A tp group is tp consecutive ranks and torchrun numbers each node's ranks consecutively: the group stays on
        one node's fast links (which every tp all-gather and reduce-scatter needs) only if tp divides the ranks per
        node, whatever parallel.pp puts outside it."""
        if self.tp > 1 and ranks_per_node < self.world_size and ranks_per_node % self.tp:
            raise LayoutError(
                f"parallel.tp = {self.tp} puts tensor-parallel groups across nodes of {ranks_per_node} ranks each; use "
                f"a tp that divides the ranks per node, e.g. --parallel.tp {math.gcd(self.tp, ranks_per_node)}",
                "tp_node",
            )

    def check_tensor_parallel(self, training: Any, model: Any) -> None:
        tp = self.tp
        for name, value in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads), ("ffn_dim", model.ffn_dim)):
            if value % tp:
                raise LayoutError(
                    f"model.{name} = {value} must be divisible by parallel.tp = {tp}; change one of them", "tp_shape"
                )
        if training.seq_len % tp:
            # Sequence parallelism gives each tp rank an equal share of every sample's tokens.
            fitting = max(tp, training.seq_len // tp * tp)
            raise LayoutError(
                f"training.seq_len ({training.seq_len}) must be divisible by parallel.tp ({tp}), which splits each "
                f"sample's tokens; e.g. --training.seq_len {fitting}",
                "tp_seq_len",
            )

    def check_context_parallel(self, training: Any) -> None:
        # Each of the cp ranks holds 2 pieces of every sequence (one early, one late: the causal mask's work
        # balanced), each split again over tp. torch falls back to unbalanced pieces, silently, when the sequence
        # does not divide into 2 x cp pieces; the tp split needs equal pieces too.
        pieces = 2 * self.cp * self.tp
        if training.seq_len % pieces:
            fitting = max(pieces, training.seq_len // pieces * pieces)
            tp = f" x parallel.tp ({self.tp})" if self.tp > 1 else ""
            raise LayoutError(
                f"training.seq_len ({training.seq_len}) must be divisible by 2 x parallel.cp ({self.cp}){tp}: context "
                f"parallelism gives each rank an early and a late piece of every sample; e.g. --training.seq_len "
                f"{fitting}",
                "cp_seq_len",
            )
        per_rank = training.seq_len // self.cp
        if per_rank % training.loss_chunks:
            raise LayoutError(
                f"training.loss_chunks ({training.loss_chunks}) must divide the {per_rank} tokens of a sample each "
                f"context-parallel rank holds (training.seq_len / parallel.cp); e.g. --training.loss_chunks "
                f"{math.gcd(per_rank, training.loss_chunks)}",
                "cp_loss_chunks",
            )

    def check_expert_parallel(self, model: Any) -> None:
        ep, n_experts = self.ep, getattr(model, "n_experts", 0)
        if ep == 1 or self.world_size == 1:  # one process (python train.py) holds every expert itself
            return
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
                f"model.n_experts ({n_experts}) must be divisible by parallel.ep ({ep}), which shares them out "
                f"equally; e.g. --parallel.ep {fitting}",
                "ep_experts",
            )

    def fitting_ep(self, n_experts: int) -> int:
        """The largest expert-parallel degree not above parallel.ep that check_expert_parallel accepts: one that
        divides both dp_shard (the ranks it borrows) and n_experts (each rank holds whole experts)."""
        return max(d for d in range(1, self.ep + 1) if self.dp_shard % d == 0 and n_experts % d == 0)

    def stage_layers(self, n_layers: int) -> list[int]:
        """How many blocks each of the pp x pp_stages_per_rank stages holds, first stage first: parallel.pp_layers,
        or as even as possible (the first stages one more)."""
        return list(self.pp_layers) or self.even_layers(n_layers)

    def even_layers(self, n_layers: int) -> list[int]:
        stages = self.pp * self.pp_stages_per_rank
        return [n_layers // stages + (1 if stage < n_layers % stages else 0) for stage in range(stages)]

    def check_pipeline(self, training: Any, model: Any) -> None:
        pp, stages = self.pp, self.pp * self.pp_stages_per_rank
        self.check_pipeline_stages_per_rank()
        if model.tie_embeddings:
            raise LayoutError(
                f"model.tie_embeddings shares one matrix between the first and the last of the {pp} pipeline stages, "
                "which pipelines cannot; use --model.tie_embeddings false, or --parallel.pp 1",
                "pp_tied",
            )
        if model.n_layers < stages:
            raise LayoutError(
                f"model.n_layers ({model.n_layers}) leaves a pipeline stage without a block: parallel.pp x "
                f"pp_stages_per_rank = {stages} stages; use fewer stages (or a deeper model)",
                "pp_layers",
            )
        if self.pp_layers and (len(self.pp_layers) != stages or sum(self.pp_layers) != model.n_layers):
            raise LayoutError(
                f"parallel.pp_layers = {list(self.pp_layers)} must give the blocks of each of the {stages} stages "
                f"(parallel.pp x pp_stages_per_rank), summing to model.n_layers ({model.n_layers}); e.g. "
                f"--parallel.pp_layers {','.join(map(str, self.even_layers(model.n_layers)))}",
                "pp_layers",
            )
        if min(self.stage_layers(model.n_layers)) < 1:
            raise LayoutError(
                f"parallel.pp_layers = {list(self.pp_layers)} leaves a pipeline stage without a block; give each "
                f"stage at least 1, e.g. --parallel.pp_layers {','.join(map(str, self.even_layers(model.n_layers)))}",
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
