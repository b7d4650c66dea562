"""Tensor parallelism for the Hugging Face model, from the plan the model itself declares: transformers models list
which of their layers split how (config.base_model_tp_plan, and the causal LM class's _tp_plan for lm_head; merged
in the model's _tp_plan), e.g. {"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head":
"colwise_gather_output"}. train.py's build_model_meta applies it on the meta model, before fully_shard shards what
each tp rank keeps over the data-parallel ranks (layout.py's fsdp_mesh, without tp).

The plan's words are translated into torch's own ParallelStyles and applied by torch's parallelize_module, not by
transformers' apply_tensor_parallelism (transformers.distributed.tensor_parallel), for three reasons:
- transformers' "replicated_with_grad_allreduce" (Qwen3's per-head q_norm / k_norm) keeps a plain parameter and
  all-reduces its gradient in a hook of its own, outside FSDP's reduce-scatter and outside DTensor: torch's
  SequenceParallel over the heads dimension makes the same weight a replicated DTensor whose partial gradient
  DTensor sums itself, which FSDP2, clipping by mesh and DCP checkpoints understand like every other parameter;
- transformers' "colwise_gather_output" gathers lm_head's whole logits on every rank; here they stay split by
  vocabulary (a DTensor) and train.py's loss_parallel computes the loss from the pieces, as for the llama family;
- transformers' styles swap each module's forward for a wrapper, with fast paths for inference (no grad) that
  leave DTensors for plain tensors; torch's styles are forward hooks, the same in training and evaluation.
Either way the weights are DTensors on the tp mesh, sharded as transformers' styles shard them: checkpoints hold
whole tensors (DCP), and pretrained weights load with each rank reading its own slices (model.py).

The input embedding (embed_tokens, which transformers' init_parallel_plans adds to every plan as
"embedding_rowwise": split by vocabulary rows) is split by its embedding dimension instead ("embedding_colwise":
torch's ColwiseParallel on nn.Embedding, each rank looks up its columns of every token, gathered after). Both keep
1/tp of the weight on a rank, but DTensor's backward of a lookup split by rows has no rule that keeps the gradient
split (aten.embedding_dense_backward's strategies): every tp rank would compute the whole (vocab, dim) gradient,
replicated, before FSDP keeps its rows (3.9 GiB in fp32 for Llama 3.1 70B's 128,256 x 8,192); split by the dimension,
each computes its (vocab, dim / tp) columns. A tied embedding stays split by rows: its weight is lm_head's, whose
vocabulary rows the plan splits for loss_parallel (one parameter, one placement); its whole gradient lives only until
it is added to lm_head's rows.

Between the layers the activations are whole (replicated over the tp ranks); each attention computes this rank's
heads (q/k/v split their outputs, o_proj sums the partial results) and each MLP this rank's share of the hidden
units. A model that declares no plan (GPT-2), or a plan word torch has no style for, stops with one line.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from transformers import PreTrainedModel

from errors import stop

# What train.py uses: loss_parallel (torch's), the context its loss and the loss's backward run in.
__all__ = ["apply_tensor_parallel", "local_loss", "loss_parallel", "torch_styles"]


def torch_style(word: str, output_layer: bool) -> ParallelStyle | None:
    """torch's ParallelStyle for one word of transformers' plans (transformers.distributed.tensor_parallel's
    ALL_PARALLEL_STYLES: the same weight placements and layouts), or None for a word without one here."""
    if output_layer and word in ("colwise_gather_output", "colwise_rep", "colwise"):
        # lm_head: the logits stay split by vocabulary (Shard(-1)), a DTensor, for loss_parallel.
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    styles = {
        "colwise": ColwiseParallel,  # weight Shard(0): this rank's output features; input whole, output split
        "rowwise": RowwiseParallel,  # weight Shard(1): this rank's input features; partial outputs summed
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # The embedding's vocabulary rows split (each rank looks up its rows, the others give 0; summed).
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        # Its embedding dimension split, gathered after the lookup.
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        # A norm between a colwise and a rowwise layer that sees this rank's heads only (Qwen3's q_norm, k_norm on
        # (batch, seq, heads, head_dim)): its weight is replicated, its input split over the heads dimension, so
        # its gradient is partial and DTensor sums it over the tp ranks.
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    }
    make = styles.get(word)
    return make() if make is not None else None


def torch_styles(model: PreTrainedModel) -> dict[str, ParallelStyle]:
    """The model's declared plan as {module name: torch ParallelStyle}, each "*" pattern of the plan resolved to
    the modules that match it. Stops with one line for a model without a
    plan or with a word torch lacks."""
    name = type(model).__name__.removeprefix("FSDP")
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        stop(f"parallel.tp: {name} declares no tensor-parallel plan (its config class's base_model_tp_plan is "
             "empty); use --parallel.tp 1 (FSDP shards it over every rank)")  # fmt: skip
    names = [key for key, _ in model.named_modules()]
    output = model.get_output_embeddings()
    output_name = next((key for key, module in model.named_modules() if module is output), None)
    # The input embedding: by its dimension, unless lm_head shares its weight (the module docstring says why).
    embedding_word = "embedding_rowwise" if tied_embeddings(model) else "embedding_colwise"
    styles = {}
    for pattern, word in plan.items():
        if word == "replicate":
            continue  # every tp rank keeps the whole tensor: nothing to split (FSDP still shards it)
        if word == "embedding_rowwise":
            word = embedding_word
        matches = re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$").match
        # A pattern may match nothing: the plan names layers this model does not have (a mixture-of-experts
        # model's plan names the dense MLP, mlp.gate_proj ..., that only its dense layers have: Qwen3-MoE's
        # mlp_only_layers; none here).
        for key in filter(matches, names):
            style = torch_style(word, output_layer=key == output_name)
            if style is None:
                stop(f"parallel.tp: {name}'s tensor-parallel plan splits {pattern} as {word!r}, which this project "
                     "does not translate to torch's styles (README.md: which dimension works for which model type); "
                     "use --parallel.tp 1")  # fmt: skip
            styles[key] = style
    return styles


def tied_embeddings(model: PreTrainedModel) -> bool:
    """Whether lm_head's weight is the input embedding's (tie_word_embeddings: one parameter, two layers)."""
    input_weight = getattr(model.get_input_embeddings(), "weight", None)
    return input_weight is not None and input_weight is getattr(model.get_output_embeddings(), "weight", None)


def apply_tensor_parallel(model: PreTrainedModel, tp_mesh: DeviceMesh) -> None:
    """Split the model's layers over the tp ranks as its declared plan says (torch_styles), before FSDP shards what
    each rank keeps over the data-parallel ranks."""
    styles = torch_styles(model)
    tied = tied_embeddings(model)
    parallelize_module(model, tp_mesh, styles)
    if tied:
        # Both layers split the (vocab, dim) matrix by vocabulary rows (embedding_rowwise, colwise), so one
        # parameter still serves both; but parallelize_module gave each module a new parameter: tie them again.
        input_layer, output_layer = model.get_input_embeddings(), model.get_output_embeddings()
        if input_layer.weight.placements != output_layer.weight.placements:
            stop(f"parallel.tp: {type(model).__name__}'s plan splits its tied input and output embeddings "
                 "differently; use --parallel.tp 1")  # fmt: skip
        output_layer.weight = input_layer.weight


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """This rank's copy of a loss computed under loss_parallel: it comes out replicated over the tp ranks (a
    DTensor), each rank's local tensor the whole loss."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
