"""Run inside a generated --moe project (PYTHONPATH=project, one process): checks moe.py's pieces against plain
reference loops written here from the papers' formulas, and prints one JSON object of the figures that
tests/test_moe.py asserts on."""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from model import Model, loss
from model_args import ModelArgs
from moe import MoE, balance_load, grouped_swiglu, looped_swiglu, moe_layers, sequence_balance_loss, use_grouped_mm
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

torch.manual_seed(0)
report: dict = {}


def tiny(**overrides) -> ModelArgs:
    settings = dict(size="debug-moe", dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
                    n_experts=4, top_k=2, moe_ffn_dim=16, n_shared_experts=1, n_dense_layers=1)  # fmt: skip
    return ModelArgs(**(settings | overrides))


def built(args: ModelArgs) -> Model:
    model = Model(args)
    model.init_weights(seed=0)
    return model.train()


# 1. DeepSeek-V3's sequence-wise balance loss, eq. 17-20, one sequence and one expert at a time:
#    L = sum_i f_i P_i, f_i = N_r / (K_r T) sum_t 1(expert i in token t's top K_r), P_i = 1/T sum_t s'_i,t,
#    s'_i,t = s_i,t / sum_j s_j,t. moe.py's returns T x L summed over the sequences.
batch, seq_len, n_experts, top_k = 3, 7, 5, 2
scores = torch.rand(batch * seq_len, n_experts, dtype=torch.float64)
chosen = torch.topk(scores + 0.1 * torch.randn(n_experts, dtype=torch.float64), top_k, dim=-1).indices
reference = 0.0
for b in range(batch):
    rows = range(b * seq_len, (b + 1) * seq_len)
    for i in range(n_experts):
        f = n_experts / (top_k * seq_len) * sum(int(i in chosen[t].tolist()) for t in rows)
        p = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / seq_len
        reference += seq_len * f * p
ours = float(sequence_balance_loss(scores, chosen, batch, n_experts, top_k))
report["aux_loss"] = {"ours": ours, "reference": reference}

# 1b. In the model: loss(aux_loss_coef c) - loss(c = 0) = c x (sum over MoE layers of the mean over sequences of
#     L), the cross-entropy being a mean over targets ("mean" reduction, no ignored target).
args = tiny(aux_loss_coef=0.25)
model = built(args)
tokens = torch.randint(0, args.vocab_size, (3, 16))
targets = torch.randint(0, args.vocab_size, (3, 16))
with_aux = float(loss(model, tokens, targets))
layer_losses = []
for layer in moe_layers(model):
    layer.aux_loss_coef = 0
without = float(loss(model, tokens, targets))
# The router's inputs: each MoE layer's scores, caught by a hook on its router.
caught = []
hooks = [layer.router.register_forward_hook(lambda m, i, out: caught.append(out)) for layer in moe_layers(model)]
loss(model, tokens, targets)
for hook in hooks:
    hook.remove()
expected = 0.0
for _weights, layer_chosen, layer_scores in caught:
    per_sequence = []
    for b in range(3):
        rows = slice(b * 16, (b + 1) * 16)
        s, c = layer_scores[rows].double(), layer_chosen[rows]
        f = torch.stack([(c == i).any(dim=-1).double().sum() for i in range(args.n_experts)]) * args.n_experts
        f = f / (args.top_k * 16)
        per_sequence.append(float((f * (s / s.sum(dim=-1, keepdim=True)).mean(dim=0)).sum()))
    expected += sum(per_sequence) / 3
report["aux_in_loss"] = {"difference": with_aux - without, "expected": 0.25 * expected, "layers": len(caught)}

# 2. The MoE layer equals a per-token loop: each token's top_k experts (chosen with the bias, weighed without it,
#    normalised, scaled), plus the shared experts.
args = tiny(score_func="sigmoid", route_scale=2.5)
layer = built(args).layers["1"].feed_forward
assert isinstance(layer, MoE)
layer.expert_bias.copy_(torch.randn(args.n_experts) * 0.1)
x = torch.randn(2, 6, args.dim)
with torch.no_grad():
    out = layer(x)
    flat = x.reshape(-1, args.dim)
    rows = []
    for token in flat:
        s = (token @ layer.router.gate.weight.T).sigmoid()
        picked = torch.topk(s + layer.expert_bias, args.top_k).indices
        w = s[picked] / s[picked].sum() * 2.5
        e = layer.experts
        routed = sum(w[j] * ((F.silu(e.w1[i] @ token) * (e.w3[i] @ token)) @ e.w2[i].T) for j, i in enumerate(picked))
        rows.append(routed + layer.shared_experts(token))
    report["moe_vs_per_token_loop"] = float((out.reshape(-1, args.dim) - torch.stack(rows)).abs().max())

# 3. torch._grouped_mm (one kernel for all experts) equals the per-expert loop, forward and backward (CPU, fp32:
#    the path moe.py takes on CPU for 16-byte-aligned widths, and on H100-class GPUs in bf16), an expert without
#    tokens included.
routed = torch.randn(24, 8)
counts = torch.tensor([5, 0, 12, 7])
weights = [torch.randn(4, 16, 8), torch.randn(4, 8, 16), torch.randn(4, 16, 8)]  # w1, w2, w3
upstream = torch.randn(24, 8)  # a gradient that is not all ones (an expanded one takes another kernel path)
results = []
for swiglu in (grouped_swiglu, looped_swiglu):
    inputs = [tensor.clone().requires_grad_() for tensor in (routed, *weights)]
    out = swiglu(inputs[0], counts, *inputs[1:])
    (out * upstream).sum().backward()
    results.append([out.detach(), *(tensor.grad for tensor in inputs)])
report["grouped_vs_looped"] = max(float((a - b).abs().max()) for a, b in zip(*results, strict=True))
report["grouped_on_cpu"] = [
    use_grouped_mm(torch.empty(2, width), hidden) for width, hidden in ((8, 16), (6, 16), (8, 6))
]

# 4. balance_load on a hand-built load (one process group of one): the sign rule, centred, and the figures.
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
args = tiny(n_dense_layers=1)  # 2 MoE layers of 4 experts
model = built(args)
first, second = moe_layers(model)
first.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 5.0, 3.0]))  # mean 5: over, under, even, under
second.tokens_per_expert.copy_(torch.tensor([5.0, 5.0, 5.0, 5.0]))  # balanced: no move
first.aux_loss_sum.fill_(6.0)
second.aux_loss_sum.fill_(2.0)
second.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.0, 0.0]))
numbers = balance_load(model, bias_rate=0.1, aux_loss_coef=0.01)
report["balance"] = {
    "figures": {name: float(value) for name, value in numbers.items()},
    "bias": [first.expert_bias.tolist(), second.expert_bias.tolist()],
    "counts_after": [first.tokens_per_expert.tolist(), float(first.aux_loss_sum)],
}

# 5. Tokens are counted once per forward, also when activation checkpointing recomputes the blocks in backward.
args = tiny(aux_loss_coef=0.01)
counted = {}
for wrapped in (False, True):
    model = built(args)
    if wrapped:
        for name in list(model.layers.keys()):
            model.layers[name] = checkpoint_wrapper(model.layers[name])
    for _ in range(2):  # two micro-batches
        loss(model, tokens, targets).backward()
    counted[wrapped] = [[*layer.tokens_per_expert.tolist(), float(layer.aux_loss_sum)] for layer in moe_layers(model)]
report["counts"] = {"plain": counted[False], "checkpointed": counted[True], "tokens": 2 * tokens.numel()}

# 6. Active parameters (what MFU counts) equal those of the built model less the unused experts' share.
args = tiny()
model = Model(args)
total = sum(p.numel() for p in model.parameters())
unused = sum(layer.experts.w1.numel() * 3 * (1 - args.top_k / args.n_experts) for layer in moe_layers(model))
# MFU's FLOPs per token: 6 x the active matmul weights (all but the input embedding and the norms) + attention's.
matmuls = total - unused - args.vocab_size * args.dim - (2 * args.n_layers + 1) * args.dim
attention_scores = 12 * args.n_layers * args.dim * 16
report["active"] = {
    "model_args": args.active_parameters(),
    "counted": total - unused,
    "flops_per_token": args.flops_per_token(16),
    "flops_counted": 6 * matmuls + attention_scores,
}

dist.destroy_process_group()
print(json.dumps(report))
