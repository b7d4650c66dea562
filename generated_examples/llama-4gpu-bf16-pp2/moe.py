"""Mixture-of-experts feed-forward (model.n_experts > 0): a router sends each token to top_k of n_experts experts.

The experts of a layer are stored stacked, one (n_experts, ...) tensor per weight, so that FSDP shards them as
three parameters (not 3 x n_experts) and expert parallelism (expert_parallel.py) places whole experts on ranks by
sharding the first dimension. Routing is dropless: every token reaches its top_k experts, whatever their load.

Load balancing, both off-able in config.toml:
- model.expert_bias_rate (default): the auxiliary-loss-free method of DeepSeek-V3. Each expert has a routing bias,
  added to its score only to choose the top_k experts; after each step (balance_load) the bias of an expert
  that received more tokens than the mean goes down by the rate, the others' up.
- model.aux_loss_coef: the sequence-wise balance loss of DeepSeek-V3 (Switch Transformer's f x P, per sequence),
  added to the training loss by model.py. Per sequence, not per batch: a sample's term depends on that sample
  only, so the loss is the same whichever rank, micro-batch or number of GPUs it falls on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from model_args import ModelArgs


class Router(nn.Module):
    """Scores every expert for every token and picks each token's top_k."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.top_k, self.score_func, self.route_scale = args.top_k, args.score_func, args.route_scale

    def forward(
        self, tokens: torch.Tensor, expert_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (n, dim) -> the weights (n, top_k, fp32) and indices (n, top_k) of each token's experts, and
        the scores of all experts (n, n_experts, fp32), which the balance loss needs."""
        # In fp32 whatever the compute dtype, the matmul included (DeepSeek-V3 keeps its gating in high precision):
        # close scores decide which experts a token goes to, and bf16 logits would tie them.
        logits = F.linear(tokens.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        # The bias changes which experts are chosen, never how much their outputs weigh (DeepSeek-V3).
        chosen = torch.topk(scores + expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        # Normalised over the chosen experts (Qwen3's norm_topk_prob, Mixtral's softmax over the top_k, DeepSeek-V3
        # for sigmoid scores), then scaled.
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return weights, chosen, scores


class GroupedExperts(nn.Module):
    """n_experts SwiGLU feed-forwards, each weight stacked over the experts: w1, w3 (n_experts, hidden, dim) and
    w2 (n_experts, dim, hidden), as nn.Linear stores its weight (out, in) per expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, routed: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """routed (n, dim): tokens sorted by expert, tokens_per_expert[e] of them for the e-th expert this module
        holds (all of them; under expert parallelism this rank's, which expert_parallel.py's hooks arrange)."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        if isinstance(w1, DTensor):
            # Under expert parallelism the gathered weights are this rank's experts of an ep-sharded DTensor.
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        if use_grouped_mm(routed, hidden=w1.shape[1]):
            return grouped_swiglu(routed, tokens_per_expert, w1, w2, w3)
        return looped_swiglu(routed, tokens_per_expert, w1, w2, w3)


def use_grouped_mm(routed: torch.Tensor, hidden: int) -> bool:
    """Whether torch._grouped_mm (one kernel for all experts, the counts read on the device) takes these tensors:
    on CUDA, bf16 on GPUs of compute capability 9.0 or newer (H100, H200, B200); on CPU (torch's reference
    kernel, forward and backward), rows of dim and hidden values that start on 16-byte boundaries. Elsewhere
    (fp32 or older GPUs, odd widths) each expert is its own matmul: the same numbers, a host sync per layer."""
    if routed.is_cuda:
        return routed.dtype == torch.bfloat16 and torch.cuda.get_device_capability(routed.device) >= (9, 0)
    return all(width * routed.element_size() % 16 == 0 for width in (routed.shape[-1], hidden))


def grouped_swiglu(
    routed: torch.Tensor, tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    # offs: where each expert's rows end in `routed` (int32, as the kernel takes them).
    ends = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    hidden = F.silu(torch._grouped_mm(routed, w1.transpose(-2, -1), offs=ends))
    hidden = hidden * torch._grouped_mm(routed, w3.transpose(-2, -1), offs=ends)
    return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=ends)


def looped_swiglu(
    routed: torch.Tensor, tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    # The split sizes must be on the host: one device-to-host copy per layer (the grouped kernel needs none), as
    # in torchtitan's loop.
    pieces = torch.split(routed, tokens_per_expert.tolist())
    outputs = [
        (F.silu(piece @ w1[expert].T) * (piece @ w3[expert].T)) @ w2[expert].T for expert, piece in enumerate(pieces)
    ]
    return torch.cat(outputs)


class FeedForward(nn.Module):
    """The shared experts: one SwiGLU of n_shared_experts x moe_ffn_dim that every token goes through."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Router, routed experts and (optionally) shared experts: a block's feed-forward from model.n_dense_layers on."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss_coef = args.n_experts, args.top_k, args.aux_loss_coef
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.moe_ffn_dim)
        shared = args.n_shared_experts * args.moe_ffn_dim
        self.shared_experts = FeedForward(args.dim, shared) if shared else None
        # The load-balancing bias (saved with the model: resuming without it would route differently), and the
        # tokens each expert received since the last balance_load (fp32: summed across ranks; not saved).
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        # The balance loss of the last training forward, summed over its tokens (model.py adds it to the loss),
        # and its running sum since the last balance_load, for metrics.jsonl.
        self.aux_loss: torch.Tensor | None = None
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        # The last training forward's tokens per expert, counted into tokens_per_expert by take_aux_loss.
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, chosen, scores = self.router(tokens, self.expert_bias)
        tokens_per_expert = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        # Each (token, choice) pair, sorted by expert (stable: the same order on any run).
        order = chosen.flatten().argsort(stable=True)
        routed = self.experts(tokens[order // self.top_k], tokens_per_expert)
        # Back to (token, choice) order, weighted and summed over the choices in fp32 (a gather, not an
        # index_add: atomics on GPUs would make the sums' order, and their rounding, vary from run to run).
        unsorted = routed[order.argsort()].view(-1, self.top_k, dim)
        out = (unsorted.float() * weights[..., None]).sum(dim=1).type_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.training:
            # Recorded, not counted: activation checkpointing runs this forward again in backward, and its
            # recomputed figures must not count twice. The model's forward counts these once (take_aux_loss).
            self.load = tokens_per_expert
            if self.aux_loss_coef and torch.is_grad_enabled():
                self.aux_loss = sequence_balance_loss(scores, chosen, batch, self.n_experts, self.top_k)
        return out.view(batch, seq_len, dim)


def sequence_balance_loss(
    scores: torch.Tensor, chosen: torch.Tensor, batch: int, n_experts: int, top_k: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without its coefficient, summed over the tokens:
    sum over sequences and their tokens t of sum_i f_i x p_i,t, where f_i = n_experts / (top_k x seq_len) x the
    sequence's tokens that chose expert i (1 for every expert when balanced) and p_i,t the token's scores
    normalised to sum to 1. Balanced routing gives 1 per token."""
    per_sequence = chosen.view(batch, -1)
    seq_len = per_sequence.shape[1] // top_k
    # (batch, n_experts): one bincount over (sequence, expert) pairs, not a one-hot (batch, seq, top_k, n_experts)
    # tensor (half a GB per layer at DeepSeek-V3's 256 experts and 4096 tokens).
    offsets = torch.arange(batch, device=chosen.device)[:, None] * n_experts
    pairs = (per_sequence + offsets).flatten()
    chosen_counts = torch.bincount(pairs, minlength=batch * n_experts).view(batch, n_experts).float()
    fraction = chosen_counts * n_experts / (top_k * seq_len)  # counts: no gradient flows through them
    probabilities = scores / scores.sum(dim=-1, keepdim=True)
    return (probabilities.view(batch, seq_len, n_experts) * fraction[:, None, :]).sum()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def forget_routing(model: nn.Module) -> None:
    """Drop what the MoE layers recorded since the last take_aux_loss: the model's forward calls it first, as a
    recompute in the last backward (activation checkpointing) recorded its figures again after they were taken."""
    for layer in moe_layers(model):
        layer.load = layer.aux_loss = None


def take_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """After the blocks of a forward: count the tokens each expert received (for balance_load), and return the
    forward's balance loss summed over the MoE layers (None when off or not training). Each layer's records are
    cleared, so that the next forward starts afresh."""
    losses = []
    for layer in moe_layers(model):
        with torch.no_grad():
            if layer.load is not None:
                layer.tokens_per_expert += layer.load
            if layer.aux_loss is not None:
                layer.aux_loss_sum += layer.aux_loss.detach()
        if layer.aux_loss is not None:
            losses.append(layer.aux_loss)
        layer.load = layer.aux_loss = None
    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def balance_load(model: nn.Module, bias_rate: float, aux_loss_coef: float) -> dict[str, torch.Tensor]:
    """After a step's micro-batches: sum each expert's tokens over all ranks, move the routing biases (bias_rate
    > 0), and return the step's load figures for metrics.jsonl (device tensors; {} without experts):
    moe_load_max_mean / moe_load_min_mean, the most and least loaded expert's tokens over the mean, worst layer
    (1.0 = balanced); moe_bias_abs_max, the largest bias; moe_aux_loss, the balance loss per token x aux_loss_coef,
    summed over the layers (the part of the logged loss that is not cross-entropy)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    # One all-reduce: every layer's loads and balance-loss sums. Ranks that see the same tokens (none in a
    # mixture-of-experts project: tensor and context parallelism are not built for it) would count them twice
    # alike, which changes neither the biases' signs nor the ratios.
    sums = torch.cat([torch.cat([layer.tokens_per_expert, layer.aux_loss_sum[None]]) for layer in layers])
    dist.all_reduce(sums)
    sums = sums.view(len(layers), -1)
    loads, aux_sums = sums[:, :-1], sums[:, -1]
    mean = loads.mean(dim=-1, keepdim=True).clamp(min=1)
    numbers = {
        "moe_load_max_mean": (loads.max(dim=-1).values / mean[:, 0]).max(),
        "moe_load_min_mean": (loads.min(dim=-1).values / mean[:, 0]).min(),
    }
    for layer, load, layer_mean in zip(layers, loads, mean, strict=True):
        if bias_rate:
            # Overloaded experts become less likely to be chosen, underloaded ones more; centred, so the biases
            # stay near 0 (adding one constant to all of them changes no choice).
            layer.expert_bias += bias_rate * torch.sign(layer_mean - load)
            layer.expert_bias -= layer.expert_bias.mean()
        layer.tokens_per_expert.zero_()
        layer.aux_loss_sum.zero_()
    numbers["moe_bias_abs_max"] = torch.stack([layer.expert_bias.abs().max() for layer in layers]).max()
    if aux_loss_coef:
        tokens = loads[0].sum() / layers[0].top_k  # each token chose top_k experts of every layer
        numbers["moe_aux_loss"] = aux_loss_coef * aux_sums.sum() / tokens.clamp(min=1)
    return numbers
