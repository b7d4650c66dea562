"""Pipeline parallelism (parallel.pp > 1): the model's blocks split into stages, micro-batches flowing through them.

The mesh's outermost dimension, pp, numbers the pipeline ranks (layout.py). The model is cut into pp x
pp_stages_per_rank stages of consecutive blocks (parallel.pp_layers, or an even split); layout.rank_stages() says
which a pp rank holds: stage s on rank s % pp (with several stages per rank, Interleaved1F1B and
InterleavedZeroBubble, rank r holds stages r, r + pp, ...), or a V under ZBVZeroBubble and DualPipeV (rank r holds
stages r and 2 x pp - 1 - r: rank 0 the first and the last). Each stage is the meta
model with the other stages' blocks deleted by name (layers.7 stays layers.7: a checkpoint saved with any pp loads
with any other), the first stage keeping the embedding, the last the final norm and output layer; then it goes
through train.py's own sequence (activation checkpointing, fully_shard, materialize) over this
pp rank's ranks, as the whole model does without PP.

torch.distributed.pipelining runs a step: the first stage takes the step's inputs, the schedule splits them into
training.grad_accum_steps micro-batches, and sends activations forward and gradients back between the pp ranks;
the last stage computes each micro-batch's loss. The schedule reduces each stage's gradients over its FSDP group
once, after the last micro-batch (training.grad_sync does not apply), and the blocks keep their gathered
parameters between a micro-batch's forward and backward (parallel.reshard_after_forward false, as torchtitan does
under PP: resharding would all-gather every block again for each micro-batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _Action,
    _ComputationType,
)

from chunked_loss import cross_entropy
from config import Config
from data import IGNORE, MicroBatch, SyntheticTokens, TokenShards, micro_batches
from layout import ParallelLayout
from model import build_model

# The zero-bubble schedules split each micro-batch's backward into the input gradient (sent to the previous stage at
# once) and the weight gradient (run later, in what would be the bubble). FSDP does not notice: the stage turns its
# gradient reduction off for every micro-batch and reduce-scatters once after the last weight gradient; whole-block
# activation checkpointing recomputes a block in the first of the two (both measured equal to one process). Op-level
# "selective" checkpointing allows one backward per block and is refused with them (config.py).
SCHEDULES = {
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


def build_pipeline(
    config: Config, mesh: DeviceMesh, device: torch.device, parallelize: Callable[..., nn.Module]
) -> PipelineModel:
    """This rank's stages, each built on the meta device, cut, then parallelize(stage, config, mesh, device)-d
    (train.py's sequence), with the schedule that runs them."""
    layout = ParallelLayout.of(config.parallel, dist.get_world_size())
    pp_rank, n_stages = mesh["pp"].get_local_rank(), layout.pp * layout.pp_stages_per_rank
    layers = layout.stage_layers(config.model.n_layers)
    # Blocks under FSDP keep their gathered parameters from a micro-batch's forward to its backward.
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, reshard_after_forward=False))
    stages, pipeline_stages = [], []
    for index in layout.rank_stages(pp_rank):
        with torch.device("meta"):
            stage = build_model(config)
        first = sum(layers[:index])
        # Every parameter's shape, in the whole model's order: initialisation draws the values of the other stages'
        # parameters too, so that this stage's get the values they have in the whole model (model.py).
        stage.whole_model_shapes = {name: param.shape for name, param in stage.named_parameters()}
        for name in list(stage.layers.keys()):
            if not first <= int(name) < first + layers[index]:
                del stage.layers[name]
        if index > 0:
            stage.tok_embeddings = None
        if index < n_stages - 1:
            stage.norm, stage.output = None, None
        stage = parallelize(stage, config, mesh, device)
        stages.append(stage)
        pipeline_stages.append(PipelineStage(stage, index, n_stages, device, group=mesh["pp"].get_group()))
    return PipelineModel(stages, pipeline_stages, mesh["pp"], config, device, layout)


def forward_only_order(schedule: PipelineScheduleMulti) -> dict[int, list[_Action]]:
    """The schedule's actions and messages without the backward ones, for evaluation under a V: torch 2.13's eval()
    runs the training order with the backward actions as no-ops, but a V's backward hands the gradient to the rank's
    other stage locally, which fails without a backward ("can't steal_bwd_input if this stage doesn't have
    backward"). The forwards keep their order, so their sends and receives still pair up."""
    kept = {_ComputationType.FORWARD, _ComputationType.SEND_F, _ComputationType.RECV_F}
    kept |= {_ComputationType.UNSHARD, _ComputationType.RESHARD}
    order: dict[int, list[_Action]] = {}
    for rank, actions in schedule.pipeline_order_with_comms.items():
        # DualPipeV runs a forward and a backward of two micro-batches as one overlapped action: keep its forward.
        flat = [sub for action in actions for sub in (action.sub_actions or (action,))]
        order[rank] = [action for action in flat if action.computation_type in kept]
    return order


class PipelineModel(nn.Module):
    """This rank's stages as one module, for the optimizer, clipping and checkpoints: its children are the stages'
    parts under the whole model's names (tok_embeddings, layers.7, norm, output), so its parameters and their
    optimizer state have the same names with any pp. It never runs itself: forward_backward() and evaluate() run
    the schedule, which calls the stages."""

    def __init__(
        self,
        stages: list[nn.Module],
        pipeline_stages: list[PipelineStage],
        pp_mesh: DeviceMesh,
        config: Config,
        device: torch.device,
        layout: ParallelLayout,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "layers":
                    self.layers.update(child)
                else:
                    self.add_module(name, child)
        self.config, self.pp_mesh, self.device = config, pp_mesh, device
        # The whole model's size (every stage's parameters), for train.py's "model: N parameters" line.
        self.whole_model_parameters = sum(shape.numel() for shape in stages[0].whole_model_shapes.values())
        # train.py's clip_grad_norm sums the squared gradient norms of the stages over this group.
        self.pp_group = pp_mesh.get_group()
        self.holds_first = pipeline_stages[0].is_first
        self.holds_last = pipeline_stages[-1].is_last
        self.loss_pp_rank = layout.loss_pp_rank  # the pp rank of the last stage, whose loss run() broadcasts
        self.scale = 1.0  # what each micro-batch's summed loss is multiplied by (train_step's scale)
        schedule_class = SCHEDULES[config.parallel.pp_schedule]
        stage_or_stages = pipeline_stages if issubclass(schedule_class, PipelineScheduleMulti) else pipeline_stages[0]
        # scale_grads=False: loss() already scales each micro-batch's loss to the step's mean over its targets.
        self.schedule = schedule_class(
            stage_or_stages,
            n_microbatches=config.training.grad_accum_steps,
            loss_fn=self.loss,
            scale_grads=False,
        )
        self.eval_order = forward_only_order(self.schedule) if layout.v_shaped else None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's cross-entropy summed over its targets (fp32, IGNORE not counted), times self.scale: the
        last stage's output is the logits (training.loss_chunks is 1 under PP)."""
        return cross_entropy(lambda hidden: hidden, logits, targets, "sum") * self.scale

    def run(self, batches: list[MicroBatch], train: bool) -> torch.Tensor:
        """Run the step's micro-batches through the schedule; the sum of their losses, on every rank of the
        pipeline (it is computed on the last stage, then broadcast over the pp group)."""
        device = self.device
        inputs = torch.cat([batch.inputs for batch in batches]).to(device)
        targets = torch.cat([batch.targets for batch in batches]).to(device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.holds_first else ()
        target = targets if self.holds_last else None
        self.run_schedule(args, target, losses, train)
        total = torch.stack(losses).sum().detach() if self.holds_last else torch.zeros((), device=device)
        dist.broadcast(total, group=self.pp_group, group_src=self.loss_pp_rank)
        return total

    def run_schedule(self, args: tuple, target: torch.Tensor | None, losses: list[torch.Tensor], train: bool) -> None:
        """One step of the schedule (train) or its forward-only pass, the last stage's losses appended to `losses`.
        return_outputs=False: by default the last stage keeps every micro-batch's output (the whole fp32 logits, batch
        x seq_len x vocabulary each) until the step ends, to return them merged; only the losses are used here."""
        if train:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        elif self.eval_order is None:
            self.schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        else:
            training_order = self.schedule.pipeline_order_with_comms
            self.schedule.pipeline_order_with_comms = self.eval_order
            try:
                self.schedule.eval(*args, target=target, losses=losses, return_outputs=False)
            finally:
                self.schedule.pipeline_order_with_comms = training_order

    def forward_backward(self, batches: list[MicroBatch], scale: torch.Tensor) -> torch.Tensor:
        """train_step's forward and backward of every micro-batch, each loss summed over its targets and multiplied
        by `scale`; the scaled loss summed over the micro-batches, on every rank."""
        self.scale = scale
        return self.run(batches, train=True)

    def evaluate(self, val_samples: TokenShards | SyntheticTokens, data_rank: int, data_ranks: int) -> float:
        """train.py's evaluate through the pipeline: the mean validation loss, the same on every rank."""
        training = self.config.training
        device = self.device
        totals = torch.zeros(2, device=device)  # the loss summed over the targets, and their number
        self.scale = 1.0
        self.eval()
        with torch.no_grad():
            for batch in range(self.config.eval.batches):
                micros = micro_batches(
                    val_samples, batch, training.global_batch_size, training.grad_accum_steps, data_rank, data_ranks
                )
                totals[0] += self.run(micros, train=False)
                totals[1] += sum((micro.targets != IGNORE).sum() for micro in micros).to(device)
        self.train()
        # Every rank of a pipeline holds the same totals: summed over all ranks, the ratio is that of the data ranks.
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return (totals[0] / totals[1].clamp(min=1)).item()
