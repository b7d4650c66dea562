"""Expert parallelism (parallel.ep > 1), in torchtitan's layout: every MoE layer's experts are shared out over the
ep ranks of a group, n_experts / ep each, and each token travels to the ranks of its experts and back.

train.py's build_model_meta calls apply_expert_parallel on the meta model, and shard_model calls shard_experts
for each block before sharding the block itself. moe.py's MoE.forward is unchanged: hooks around its
GroupedExperts (torch's distribute_module) turn the call experts(routed, tokens_per_expert), made with every
expert's tokens of this rank, into one over the tokens the group's ranks sent to this rank's experts:

  dispatch  exchange the token counts per expert (all-to-all of n_experts numbers), then the tokens themselves
            (all-to-all of uneven pieces: rank r gets the tokens for its experts from every rank of the group);
            they arrive grouped by sender, then expert, and are reordered by expert, then sender.
  combine   the experts' outputs back in arrival order, then to the ranks that sent them (the reverse
            all-to-all); MoE.forward weighs and sums them as without expert parallelism.

Autograd runs the same exchanges backward (all_to_all_single_autograd). The expert weights are DTensors sharded
by expert (Shard(0)) over mesh["ep"]; FSDP then shards each rank's experts over the ranks that hold the same
ones (layout.py's expert_fsdp_mesh: dp_shard / ep ranks, per replica with HSDP), and divides their gradients
by the same factor as every other gradient's. Checkpoints hold the whole stacked tensors, whatever ep was.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from config import ParallelConfig
from layout import ParallelLayout
from moe import GroupedExperts


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig) -> None:
    """Share out every GroupedExperts' experts over mesh["ep"] (nothing when parallel.ep = 1 or one process), and
    record on each the mesh that shard_experts shards it over."""
    if "ep" not in (mesh.mesh_dim_names or ()):
        return
    ep_mesh = mesh["ep"]
    expert_fsdp_mesh = ParallelLayout.of(parallel, dist.get_world_size()).expert_fsdp_mesh(mesh)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            exchange = TokenExchange(ep_mesh)
            distribute_module(module, ep_mesh, shard_by_expert, exchange.dispatch, exchange.combine)
            module.expert_fsdp_mesh = expert_fsdp_mesh


def shard_by_expert(name: str, module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """distribute_module's partition_fn: each stacked weight (n_experts, ...) split by expert over the ep ranks."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))


class TokenExchange:
    """dispatch and combine for one GroupedExperts: combine undoes what the dispatch of the same forward did."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        # Set by dispatch for combine: the token counts this rank sent to and received from each rank, and where
        # each received token went in expert order.
        self.sent: list[int] = []
        self.received: list[int] = []
        self.order = torch.empty(0)

    def dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], ep_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed, tokens_per_expert) of all n_experts, this rank's tokens -> the same for this rank's experts,
        the tokens every rank of the group routed to them."""
        routed, tokens_per_expert = inputs
        with torch.no_grad():
            # counts[s, e]: the tokens rank s of the group sends to this rank's e-th expert.
            counts = torch.empty_like(tokens_per_expert)
            dist.all_to_all_single(counts, tokens_per_expert, group=self.group)
            counts = counts.view(self.ep, -1)
            # The pieces' sizes, on the host (the all-to-all needs them there): one copy per MoE layer.
            self.sent = tokens_per_expert.view(self.ep, -1).sum(dim=1).tolist()
            self.received = counts.sum(dim=1).tolist()
            self.order = sender_to_expert_order(counts)
        arrived = all_to_all_single_autograd(routed, self.received, self.sent, self.group)
        return arrived[self.order], counts.sum(dim=0)

    def combine(self, module: nn.Module, output: torch.Tensor, ep_mesh: DeviceMesh) -> torch.Tensor:
        """The experts' outputs, in dispatch's expert order -> the outputs of this rank's tokens, in routed order."""
        # Back to arrival order (sender, then expert): a gather by the inverse permutation.
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(len(self.order), device=self.order.device)
        return all_to_all_single_autograd(output[inverse], self.sent, self.received, self.group)


def sender_to_expert_order(counts: torch.Tensor) -> torch.Tensor:
    """The tokens arrive as blocks (sender s, expert e), counts[s, e] tokens each, s-major: the indices that put
    them e-major (each expert's tokens together, in sender order, so each sender's tokens keep their order)."""
    flat = counts.flatten()
    starts = (flat.cumsum(0) - flat).view_as(counts)  # where each block starts in arrival order
    # The blocks in expert order, then each token of a block: its block's start plus its place in the block.
    block_counts, block_starts = counts.T.flatten(), starts.T.flatten()
    block = torch.repeat_interleave(torch.arange(len(block_counts), device=counts.device), block_counts)
    first_of_block = torch.repeat_interleave(block_counts.cumsum(0) - block_counts, block_counts)
    return block_starts[block] + torch.arange(len(block), device=counts.device) - first_of_block


def shard_experts(block: nn.Module, block_options: dict[str, Any]) -> None:
    """fully_shard the block's expert-parallel experts (if any) as groups of their own, before the block, with the
    block's options (mixed precision, CPU offload, resharding) over their own mesh."""
    for module in block.modules():
        mesh = getattr(module, "expert_fsdp_mesh", None)
        if mesh is None:
            continue
        options = {**block_options, "mesh": mesh}
        local_experts, shard_ranks = module.w1.to_local().shape[0], mesh.size(mesh.ndim - 1)
        rows_split_evenly = all(param.shape[1] % shard_ranks == 0 for param in module.parameters())
        if shard_ranks > local_experts and rows_split_evenly:
            # Fewer experts on a rank than ranks to shard them over: shard each expert's rows instead (as
            # torchtitan does), so that no rank's shard is empty padding. (FSDP needs equal rows per rank there.)
            options["shard_placement_fn"] = lambda param: Shard(1)
        reshard = options["reshard_after_forward"]
        if not isinstance(reshard, bool) and (reshard >= shard_ranks or shard_ranks % reshard):
            # Groups of N ranks that do not fit in this smaller shard group: reshard fully (least memory).
            reshard = True
        options["reshard_after_forward"] = reshard
        fully_shard(module, **options)
        # The experts' gradients are summed over the ep ranks by the all-to-all's backward and reduced over
        # their own mesh: divided like every other gradient (by all the data-parallel ranks, FSDP's default for
        # the block's mesh), each rank's tokens count once, as without expert parallelism.
        module.set_gradient_divide_factor(float(math.prod(block_options["mesh"].shape)))
        if mesh.device_type == "cpu" and shard_ranks > 1:
            # Gloo has no pre-multiplied sum (NCCL's PREMUL_SUM, which a divide factor uses): sum, then divide.
            # (A group of one rank reduces nothing: FSDP divides as it copies, and would divide again after a
            # forced sum, torch 2.13.)
            module.set_force_sum_reduction_for_comms(True)
