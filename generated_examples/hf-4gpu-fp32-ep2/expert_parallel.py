"""Expert parallelism for the Hugging Face model (parallel.ep > 1), from the plan the model itself declares:
transformers' mixture-of-experts models list how their experts split in config.base_model_ep_plan, e.g. Qwen3-MoE's
and Mixtral's {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj":
"grouped_gemm", "layers.*.mlp.experts": "ep_dispatch_experts"}: every stacked expert weight (num_experts, ...) split
by expert (Shard(0)) over the ep ranks of a group, num_experts / ep each, and the experts module reached through
an all-to-all that sends each token to the ranks of its experts and back.

train.py's parallelize calls apply_expert_parallel on the meta model, and shard_model calls shard_experts for each
block before sharding the block itself. The plan is applied by transformers' own apply_expert_parallelism
(transformers.distributed.expert_parallel, what from_pretrained(distributed_config=...) runs): its "grouped_gemm"
style makes each expert weight a DTensor sharded by expert over mesh["ep"], and its "ep_dispatch_experts" style
wraps the experts' forward(hidden_states, top_k_index, top_k_weights) in AllToAllEP: the token counts per expert
exchanged (one host copy per MoE layer), the tokens sent to their experts' ranks, this rank's experts run on what
arrived, the outputs sent back, weighted and summed per token. Autograd runs the same exchanges backward.

What is not transformers': the FSDP of the experts. transformers' own FSDP path (distributed/fsdp.py) shards the
whole model with its own options; here shard_experts shards each rank's experts, as the llama family's EP does, over
the ranks that hold the same ones (layout.py's expert_fsdp_mesh: dp_shard / ep ranks, x cp with context
parallelism, whose ranks hold the same experts and route other tokens to them; per replica with HSDP) with the
block's options (mixed precision, CPU offload, resharding), and divides their gradients like every other
gradient's. Checkpoints hold the whole stacked tensors under the model's own names, whatever ep was, so they resume
with any ep; pretrained weights load with each rank reading only its experts' slices (model.py's load_pretrained).
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from transformers import PreTrainedModel
from transformers.distributed.expert_parallel import apply_expert_parallelism

from config import ParallelConfig
from errors import stop
from layout import ParallelLayout

# The words of the declared plans that transformers' apply_expert_parallelism applies as this module expects: the
# expert weights split by expert, the experts module reached by token dispatch.
PLAN_WORDS = ("grouped_gemm", "ep_dispatch_experts")


def apply_expert_parallel(model: PreTrainedModel, mesh: DeviceMesh, parallel: ParallelConfig) -> None:
    """Share out every MoE layer's experts over mesh["ep"] as the model's declared plan says (nothing when
    parallel.ep = 1 or one process), and record on each experts module the mesh that shard_experts shards it over."""
    if "ep" not in (mesh.mesh_dim_names or ()):
        return
    ep_mesh = mesh["ep"]
    plan = expanded_plan(model, ep_mesh.size())
    # AllToAllEP's tensor-parallel mesh: the ranks that hold the same batch, which it splits among them before the
    # dispatch. Here every rank reads its own samples (ep borrows data-parallel ranks; --tp with --ep is refused):
    # a mesh of this rank alone, from a group that only this rank creates (no collective over the world).
    alone = DeviceMesh.from_group(dist.new_group([dist.get_rank()], use_local_synchronization=True), mesh.device_type)
    experts = [model.get_parameter(key).shape[0] for key, word in plan.items() if word == "grouped_gemm"]
    apply_expert_parallelism(model, ep_mesh, alone, plan, ep_implementation="all_to_all")
    expert_fsdp_mesh = ParallelLayout.of(parallel, dist.get_world_size()).expert_fsdp_mesh(mesh)
    layers = [name for name, word in plan.items() if word == "ep_dispatch_experts"]
    for name in layers:
        model.get_submodule(name).expert_fsdp_mesh = expert_fsdp_mesh
    if dist.get_rank() == 0:
        print(f"expert parallelism: {experts[0] // ep_mesh.size()} of the {experts[0]} experts of each of "
              f"{len(layers)} mixture-of-experts layers per rank, sharded over the {expert_fsdp_mesh.size()} ranks "
              "that hold the same ones", flush=True)  # fmt: skip


def expanded_plan(model: PreTrainedModel, ep: int) -> dict[str, str]:
    """The model's declared expert-parallel plan (model.ep_plan: its config class's base_model_ep_plan, prefixed),
    one entry per module or parameter (transformers' own expansion of the "*"). Stops with one line for a model that
    declares none, a word this module does not apply, or experts that ep ranks cannot share out equally."""
    name = type(model).__name__.removeprefix("FSDP")
    declared = dict(model.ep_plan or {})
    if not declared:
        stop(f"parallel.ep: {name} declares no expert-parallel plan (its config class's base_model_ep_plan is "
             "empty: a dense model has no experts to share out); use --parallel.ep 1")  # fmt: skip
    unknown = sorted({word for word in declared.values() if word not in PLAN_WORDS})
    if unknown:
        stop(f"parallel.ep: {name}'s expert-parallel plan uses {unknown}, which this project does not apply (only "
             f"{list(PLAN_WORDS)}); use --parallel.ep 1")  # fmt: skip
    plan = model._expand_parallel_plan(declared)
    if "ep_dispatch_experts" not in plan.values():
        stop(f"parallel.ep: {name}'s expert-parallel plan names no module of the model; use --parallel.ep 1")
    for key, word in plan.items():
        if word != "grouped_gemm":
            continue
        experts = model.get_parameter(key).shape[0]
        if experts % ep:
            fitting = math.gcd(experts, ep)
            stop(f"parallel.ep: {key} holds {experts} experts, which {ep} ranks cannot share out equally; use a "
                 f"divisor of {experts}, e.g. --parallel.ep {fitting}")  # fmt: skip
    return plan


def shard_experts(block: nn.Module, block_options: dict[str, Any]) -> None:
    """fully_shard the block's expert-parallel experts (if any) as groups of their own, before the block, with the
    block's options (mixed precision, CPU offload, resharding) over their own mesh."""
    for module in block.modules():
        mesh = getattr(module, "expert_fsdp_mesh", None)
        if mesh is None:
            continue
        options = {**block_options, "mesh": mesh}
        params = list(module.parameters())
        local_experts, shard_ranks = params[0].to_local().shape[0], mesh.size(mesh.ndim - 1)
        if shard_ranks > local_experts and all(param.shape[1] % shard_ranks == 0 for param in params):
            # Fewer experts on a rank than ranks to shard them over: shard each expert's rows instead (as
            # torchtitan does), so that no rank's shard is empty padding. (FSDP needs equal rows per rank there.)
            options["shard_placement_fn"] = lambda param: Shard(1)
        reshard = options["reshard_after_forward"]
        if not isinstance(reshard, bool) and (reshard >= shard_ranks or shard_ranks % reshard):
            # Groups of N ranks that do not fit in this smaller shard group: reshard fully (least memory).
            reshard = True
        options["reshard_after_forward"] = reshard
        fully_shard(module, **options)
        # The experts' gradients are summed over the ep ranks by the all-to-all's backward and reduced over their
        # own mesh (with cp, its ranks too): divided like every other gradient (by all the ranks of the block's
        # mesh, data-parallel x cp: FSDP's default there), each rank's tokens count once, as without expert
        # parallelism (transformers' fsdp.py does the same).
        module.set_gradient_divide_factor(float(math.prod(block_options["mesh"].shape)))
        if mesh.device_type == "cpu" and shard_ranks > 1:
            # Gloo has no pre-multiplied sum (NCCL's PREMUL_SUM, which a divide factor uses): sum, then divide.
            # (A group of one rank reduces nothing: FSDP divides as it copies, and would divide again after a
            # forced sum, torch 2.13.)
            module.set_force_sum_reduction_for_comms(True)
