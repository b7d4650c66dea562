"""What autograd keeps for backward, op by op, per GPU: a block's, the loss's, under each activation checkpointing
mode, and the exchange buffers of context and expert parallelism."""

from __future__ import annotations

import math

from fsdp2gen.plan_families import (
    ATTENTION,
    FORWARD_ORDER,
    HfShape,
    hf_block_with_lora_bytes,
    lora_op_level_delta,
    lora_targets,
)
from fsdp2gen.plan_layout import AC_MODES, PlanRequest
from fsdp2gen.plan_shapes import FP32, INT64
from fsdp2gen.sizes import (
    LlamaShape,
)


def norm_activation_bytes(hidden: int, compute: int) -> int:
    """RMSNorm's saved tensors for `hidden` elements, in model.py's fp32-normalising forward.

    fp32: the input (pow, mul) and the normalised x (weight mul). bf16/fp16: two fp32 copies of the input
    (x.float() is called twice) and the normalised x cast back to the compute dtype.
    """
    return 2 * FP32 * hidden if compute == FP32 else (2 * FP32 + compute) * hidden


def moe_activation_parts(model: LlamaShape, tokens: int, compute: int, ep: int = 1) -> dict[str, int]:
    """What one mixture-of-experts feed-forward (moe.py's MoE) saves for backward, for `tokens` tokens on one rank,
    by part; all of it is held until the block's backward. (Its input, the normalised tokens, is counted with the
    block: the router's gate and the shared experts read it as a dense block's w1/w3 do.)

    - router: the scores of all experts (softmax or sigmoid output, fp32), the top_k chosen scores and their sum
      (the normalisation's division keeps both) and the normalised weights (the combine's multiply keeps them);
    - indices: the chosen experts (topk's and gather's), the sorted choices' token indices (the dispatch gather)
      and the inverse order (the combine gather), int64, tokens x top_k each; with ep > 1 two more, the orders
      expert_parallel.py puts the received copies in (by expert) and back (by sender);
    - routed copies: tokens x top_k copies of the tokens in expert order, the experts' input (compute dtype);
      under expert parallelism the copies this rank received from the dispatch all-to-all instead, as many when
      the routing is balanced;
    - expert hidden: per routed copy the SwiGLU's w1 output, silu output, w3 output and their product;
    - combine: the experts' outputs back in token order, in fp32 for the weighted sum over the top_k choices;
    - shared experts: a dense SwiGLU of n_shared_experts x moe_ffn_dim hidden units.
    The auxiliary balance loss (model.aux_loss_coef > 0) adds one fp32 per token (the scores' sums): not counted.
    """
    routed = tokens * model.top_k
    return {
        "router": FP32 * tokens * (model.n_experts + 2 * model.top_k + 1),
        "indices": INT64 * (3 if ep == 1 else 5) * routed,
        "routed copies": compute * routed * model.dim,
        "expert hidden": 4 * compute * routed * model.moe_ffn_dim,
        "combine": FP32 * routed * model.dim,
        "shared experts": 4 * compute * tokens * model.n_shared_experts * model.moe_ffn_dim,
    }


def all_to_all_bytes(model: LlamaShape, tokens: int, compute: int, ep: int) -> int:
    """Expert parallelism's dispatch and combine all-to-alls for one MoE layer: each rank sends its tokens x top_k
    routed copies and receives as many (balanced routing), in the compute dtype; the send and receive buffers of
    one exchange coexist, and backward exchanges the gradients the same way. Not held for backward (the received
    copies are: moe_activation_parts' routed copies), so one layer's pair at the peak (an hf model's transformers'
    AllToAllEP sends and receives the same copies). 0 without ep."""
    if ep == 1 or not model.n_experts:
        return 0
    return 2 * compute * tokens * model.top_k * model.dim


def grouped_backward_bytes(model: LlamaShape, tokens: int, compute: int) -> int:
    """The grouped GEMM's backward (moe.py's grouped_swiglu, torch._grouped_mm: what H100-class GPUs run in bf16):
    each weight gradient multiplies the transposed routed copies and output gradients, which the kernel takes
    row-major, so it copies both: tokens x top_k x (dim + moe_ffn_dim) in the compute dtype at w1's/w3's, one
    layer at a time. Measured by the simulation (fake tensors run the kernel's layout rules); 0 for a dense model.

    An hf model's experts (transformers' grouped_mm on the transposed fused weights): the gate_up_proj weight's
    gradient as the kernel returns it (transposed: autograd copies it into the parameter's layout, both alive), with
    the gradients of the routed copies and of gate_up_proj's output (tokens x top_k x (dim + 2 x moe_ffn_dim)), as
    the simulated steps of Qwen3-30B-A3B and Mixtral 8x7B hold them (tests/test_plan_simulation.py's MoE rows)."""
    if not model.n_experts or not model.moe_layers:
        return 0
    if isinstance(model, HfShape):  # (LoRA: frozen experts, no weight gradient)
        weight = model.n_experts * 2 * model.moe_ffn_dim * model.dim if model.lora is None else 0
        return compute * (weight + tokens * model.top_k * (model.dim + 2 * model.moe_ffn_dim))
    return compute * tokens * model.top_k * (model.dim + model.moe_ffn_dim)


def block_activation_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, moe: bool = False, ep: int = 1
) -> int:
    """Bytes one TransformerBlock saves for backward, for `batch` x `seq_len` tokens, on one rank (`moe`: a
    mixture-of-experts block, whose feed-forward saves moe_activation_parts; no tensor parallelism there).

    With tp > 1 (train.py's apply_tensor_parallel, torchtitan's layout) a rank holds 1/tp of everything (the
    norms' tokens, the attention heads, the MLP's hidden units) except the inputs of wq/wk/wv and of w1/w3:
    attention and the MLP all-gather the sequence, and their first matmuls keep that full input for backward.
    """
    tokens = batch * seq_len
    hidden = tokens * model.dim
    kv = tokens * model.n_kv_heads * model.head_dim
    ffn = tokens * model.ffn_dim
    split = 2 * norm_activation_bytes(hidden, compute)
    # Rotated q, k, v and the attention output (laid out as batch, seq, heads, so wo's input is a view of it).
    split += compute * (hidden + 2 * kv + hidden)
    # w1 output (silu), silu output and w3 output (their product), and w2's input.
    split += sum(moe_activation_parts(model, tokens, compute, ep).values()) if moe else 4 * compute * ffn
    # rsqrt of both norms and attention's logsumexp, in fp32.
    split += FP32 * (2 * tokens + batch * model.n_heads * seq_len)
    # The input of wq/wk/wv (one tensor) and the input of w1/w3: full sequence on every tp rank.
    whole = compute * 2 * hidden
    if compute != FP32:
        # MixedPrecisionPolicy casts the block's rotary inputs, (cos, cos) and (-sin, sin), to the compute dtype.
        whole += 2 * seq_len * model.head_dim * compute
    return math.ceil(split / tp) + whole


def head_activation_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, loss_chunks: int = 1
) -> int:
    """Final norm, output layer input, the fp32 log-softmax of the loss, and the token ids and targets.

    With tp > 1 the final norm's tokens and the logits' vocabulary are split (loss_parallel); the output
    layer's input (all-gathered) and the token ids are whole on every tp rank. With loss_chunks > 1
    (chunked_loss.py) the log-softmax is that of one chunk of the sequence: forward keeps none, and backward
    recomputes one chunk at a time while every block's activations are still held.
    """
    tokens = batch * seq_len
    hidden = tokens * model.dim
    split = norm_activation_bytes(hidden, compute) + FP32 * tokens
    return (
        math.ceil(split / tp)
        + FP32 * batch * math.ceil(seq_len / loss_chunks) * math.ceil(model.vocab_size / tp)
        + compute * hidden
        + 2 * INT64 * tokens
        + FP32  # cross_entropy's total_weight
    )


def loss_backward_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, loss_chunks: int = 1
) -> int:
    """What the loss's backward adds to the saved activations, at its peak. The loss is computed inside the
    model's forward (chunked_loss.py), so nothing outside it holds the logits; the cross-entropy saved its fp32
    log-softmax (head_activation_bytes). Its backward makes fp32 tensors of the logits' size: two (the gradients
    of the log-softmax's output and of its input) without tensor parallelism, three with loss_parallel (the
    one-hot mask, exp(log-softmax), the scaled gradient). With loss_chunks > 1 those are one chunk's, and the
    output layer's unsharded gradient (compute dtype) is there from the first chunk on, summing the chunks'.
    Measured with scripts/plan_memory.py (FSDPMemTracker); tests/test_plan_simulation.py checks it.
    """
    vocab = math.ceil(model.vocab_size / tp)
    chunk_logits = FP32 * batch * math.ceil(seq_len / loss_chunks) * vocab
    gradients = (3 if tp > 1 else 2) * chunk_logits
    if loss_chunks == 1:
        return gradients
    return gradients + compute * vocab * model.dim


def op_level_kept_bytes(
    model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, moe: bool = False
) -> int:
    """Bytes one block keeps under op-level selective AC (activation_checkpoint.py, torchtitan's policy): the
    outputs of its 1st, 3rd, 5th and 7th matmuls (wq, wv, w1, w2; wk, wo and w3 are recomputed), attention's
    output and logsumexp, and with tp > 1 the two reduce-scatters' outputs (wo's and w2's, sequence-split).

    tp > 1: wq/wv/w1 outputs hold this rank's heads or hidden units (1/tp); w2's output is the full-sequence
    partial sum that the reduce-scatter then splits. (tests/test_op_level_ac.py measures this figure.)

    `moe`: a mixture-of-experts block's 5th matmul is the router's gate (its output kept), then every other one of
    the experts' w1, w3, w2 matmuls of the per-expert loop (about half of their outputs) and of the shared
    experts'. On H100-class GPUs in bf16 the experts run as torch._grouped_mm, which the policy does not keep: this
    counts the loop's (an upper bound there; not checked against a measurement).
    """
    if moe:
        tokens = batch * seq_len
        attention = compute * (2 * tokens * model.dim + tokens * model.n_kv_heads * model.head_dim)
        attention += FP32 * batch * model.n_heads * seq_len
        routed = tokens * model.top_k
        shared = model.n_shared_experts * model.moe_ffn_dim
        experts = compute * (routed * (2 * model.moe_ffn_dim + model.dim) + tokens * (2 * shared + model.dim)) // 2
        return attention + compute * tokens * model.n_experts + experts
    tokens = batch * seq_len
    hidden = tokens * model.dim
    kv = tokens * model.n_kv_heads * model.head_dim
    ffn = tokens * model.ffn_dim
    # wq's, wv's and w1's outputs, attention's output and logsumexp.
    split = compute * (hidden + kv + ffn + hidden) + FP32 * batch * model.n_heads * seq_len
    if tp > 1:
        split += 2 * compute * hidden  # the reduce-scatters' outputs
    return math.ceil(split / tp) + compute * hidden  # + w2's matmul output


def activation_bytes(
    model: LlamaShape,
    batch: int,
    seq_len: int,
    compute: int,
    ac: str,
    tp: int = 1,
    loss_chunks: int = 1,
    ep: int = 1,
    every: int = 2,
) -> int:
    """Saved activations per GPU at the end of forward (the peak), for one activation checkpointing mode.

    full: every block keeps only its input, and backward recomputes one block at a time.
    layer: every `every`-th block (index 0, every, ...: parallel.activation_checkpoint_every, 2 by default as
    torchtitan's selective_ac_option=2) is checkpointed whole.
    selective: op-level, every block keeps its input and its expensive ops' outputs (op_level_kept_bytes), and
    backward recomputes the rest of one block at a time.
    With tp > 1 a block's input is this rank's 1/tp of the sequence (sequence parallelism).
    """
    # An hf model's routed blocks are counted by family_activation_bytes (transformers' experts, not moe.py's).
    moe = [not isinstance(model, HfShape) and i in model.moe_layers for i in range(model.n_layers)]
    blocks = {kind: block_activation_bytes(model, batch, seq_len, compute, tp, kind, ep) for kind in set(moe)}
    block_input = math.ceil(compute * batch * seq_len * model.dim / tp)
    head = head_activation_bytes(model, batch, seq_len, compute, tp, loss_chunks)
    if ac == "selective":
        kept = sum(op_level_kept_bytes(model, batch, seq_len, compute, tp, kind) for kind in moe)
        return model.n_layers * block_input + kept + max(blocks.values()) + head
    # layer: blocks 0, every, 2 x every, ... are checkpointed; full: all of them. Backward recomputes one at a time.
    checkpointed = {"none": [], "layer": moe[::every], "full": moe}[ac]
    kept = sum(blocks[kind] for kind in moe) - sum(blocks[kind] for kind in checkpointed)
    recompute = max((blocks[kind] for kind in checkpointed), default=0)
    return kept + len(checkpointed) * block_input + recompute + head


def ring_attention_bytes(model: LlamaShape, batch: int, seq_len: int, compute: int, tp: int = 1, cp: int = 1) -> int:
    """Working memory of one block's ring attention under context parallelism (0 without: plain SDPA), at its
    largest, in the block's backward while every other block's activations are held. `seq_len` is the whole
    sample's; a rank holds seq_len / cp of its tokens, and this tp rank's heads (K/V: the kv heads, which the flash
    kernel takes as they are under GQA).

    torch 2.13's context_parallel rotates K/V with an all-gather by default (_ContextParallelOptions.rotate_method
    ALL_GATHER; set_rotate_method("alltoall") would hold 2 chunks instead of cp). Its backward
    (_templated_ring_attention_backward) gathers the whole sequence's K/V of the layer once; accumulates the
    gradients of q, k and v in fp32 (convert_to_f32), passing the K/V gradients around the ring with all-to-all (the
    one sent and the one received); the load balancing's partial updates copy the q accumulator and half of the
    logsumexp. Per element of the rank's local q, K/V and logsumexp, the peak is exactly (measured with torch's
    MemTracker on gloo ranks for bf16 and fp32, cp 2 and 4, grouped-query attention: tests/test_plan_cp.py; with
    n_heads == n_kv_heads it peaks at another moment, a few % higher):
    q: 2 fp32 + compute / 2; K/V: 4 compute + 2 fp32; the gathered K/V: cp x compute; logsumexp: fp32 / 2.
    (The flash kernel's own workspace is not counted, as it is not without CP.)
    """
    if cp == 1:
        return 0
    local = batch * (seq_len // cp)
    q = math.ceil(local * model.n_heads * model.head_dim / tp)
    kv = 2 * math.ceil(local * model.n_kv_heads * model.head_dim / tp)  # K and V
    lse = math.ceil(local * model.n_heads / tp)
    return (2 * FP32 * q + compute * q // 2) + (4 * compute + 2 * FP32) * kv + compute * cp * kv + FP32 * lse // 2


def family_activation_bytes(model: LlamaShape, batch: int, seq_len: int, compute: int, ac: str, every: int = 2) -> int:
    """How an hf model's activations differ from activation_bytes' llama count: rotary's cos and sin, computed
    once per forward (batch x seq x head_dim each, compute dtype) and used by every block; the final norm's one
    fp32 copy (model.py keeps two); and in each block that keeps its activations, and the one backward
    recomputes (the largest: a routed block's, in a mixture-of-experts model), a transformers block's own count
    (hf_block_activation_bytes) with LoRA's change (lora_activation_delta). Selective AC: the recomputed block
    only; the kept matmul outputs are op_level_kept_bytes' llama count, but in routed blocks (routed_kept_bytes)."""
    if not isinstance(model, HfShape):
        return 0
    rotary = 2 * compute * batch * seq_len * model.head_dim
    # The final norm: transformers' RMSNorm keeps one fp32 copy of its input where model.py's keeps two.
    hidden = batch * seq_len * model.dim
    final_norm = (FP32 + compute) * hidden - norm_activation_bytes(hidden, compute)
    llama = block_activation_bytes(model, batch, seq_len, compute)
    blocks = [hf_block_with_lora_bytes(model, batch, seq_len, compute, i) for i in range(model.n_layers)]
    # The blocks whose activations backward recomputes (one at a time): those checkpointed whole, or all (selective).
    recomputed = {"none": [], "layer": blocks[::every], "full": blocks, "selective": blocks}[ac]
    kept = {"none": blocks, "layer": [block for i, block in enumerate(blocks) if i % every]}.get(ac, [])
    difference = sum(kept) - len(kept) * llama + max(recomputed, default=llama) - llama
    if ac == "selective":
        # With LoRA every block keeps more matmul outputs (lora_op_level_delta); a routed block keeps others.
        difference += model.n_layers * lora_op_level_delta(model, batch, seq_len, compute)
        routed = routed_kept_bytes(model, batch, seq_len, compute) - op_level_kept_bytes(model, batch, seq_len, compute)
        difference += len(model.moe_layers) * routed
    return rotary + final_norm + difference


def routed_kept_bytes(model: HfShape, batch: int, seq_len: int, compute: int) -> int:
    """What a routed hf block keeps under op-level selective AC: the outputs of every second matmul in forward order
    (q, v; the router's scores; down_proj's grouped GEMM, per routed copy; k, o and gate_up recomputed), attention's
    output and logsumexp."""
    tokens = batch * seq_len
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    matmuls = tokens * (q + kv + model.n_experts) + tokens * model.top_k * model.dim
    return compute * (matmuls + tokens * q) + FP32 * batch * model.n_heads * seq_len


def hf_tp_saving(
    model: HfShape, batch: int, seq_len: int, compute: int, ac: str, tp: int, loss_chunks: int = 1, every: int = 2
) -> int:
    """What tensor parallelism takes off an hf model's activations (family_activation_bytes' count at tp 1), per
    rank. The project's tensor_parallel.py applies the model's declared plan without sequence parallelism: between
    the layers the activations are whole on every tp rank (each block's input, the norms, the inputs of q/k/v and
    of gate/up, the final norm and the output layer's input), so only what the split layers compute is split
    (hf_tp_split_bytes, block by block: a routed block's experts are whole), and the logits (by vocabulary, for
    loss_parallel). Under AC the recomputed block is the largest one left after the split.
    Unlike the llama family's tp (block_activation_bytes: sequence parallelism splits all but two inputs)."""
    if tp == 1:
        return 0
    tokens = batch * seq_len
    parts = [[tp_share_saved(part, tp) for part in hf_tp_split_bytes(model, tokens, compute, i)]
             for i in range(model.n_layers)]  # fmt: skip
    whole = [hf_block_with_lora_bytes(model, batch, seq_len, compute, i) for i in range(model.n_layers)]
    layers = {"none": range(model.n_layers), "layer": [i for i in range(model.n_layers) if i % every]}
    recomputed = {"none": [], "layer": range(0, model.n_layers, every)}.get(ac, range(model.n_layers))
    saved = sum(parts[i][0] for i in layers.get(ac, []))
    if recomputed:
        saved += max(whole[i] for i in recomputed) - max(whole[i] - parts[i][0] for i in recomputed)
    if ac == "selective":
        saved += sum(kept for _, kept in parts)
    logits = FP32 * batch * math.ceil(seq_len / loss_chunks)  # one chunk's log-softmax (head_activation_bytes)
    return saved + logits * (model.vocab_size - math.ceil(model.vocab_size / tp))


def hf_tp_split_bytes(model: HfShape, tokens: int, compute: int, layer: int = 0) -> tuple[int, int]:
    """Of hf block `layer`'s saved activations for `tokens` tokens, the parts tensor parallelism splits (each tp
    rank holds 1/tp of them): of the whole block (hf_block_activation_bytes) the rotated q, k, v, the attention
    output and logsumexp (this rank's heads; Qwen3's q_norm and k_norm too) and a dense MLP's hidden units (gate,
    silu, up, their product); and of what selective AC keeps (op_level_kept_bytes) q's, v's and gate's matmul
    outputs, attention's output and logsumexp (down_proj's output is a whole partial sum).
    A routed block (layer in moe_layers): its router and experts stay whole on every tp rank, which run them all on
    the same whole tokens (the declared tp plans of Qwen3-MoE and Mixtral name the attention and a dense MLP only;
    the experts are split by ep, base_model_ep_plan), so only its attention's part is split."""
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    attention = compute * (2 * q + 2 * kv) + FP32 * model.n_heads
    if model.qk_norm:
        attention += (FP32 + compute) * (q + kv) + FP32 * (model.n_heads + model.n_kv_heads)
    dense = layer not in model.moe_layers
    block = tokens * (attention + 4 * compute * model.ffn_dim * dense)
    kept = compute * tokens * (q + kv + model.ffn_dim * dense + q) + FP32 * tokens * model.n_heads
    lora_block, lora_kept = lora_tp_split_bytes(model, tokens, compute, dense)
    return block + lora_block, kept + lora_kept


def lora_tp_split_bytes(model: HfShape, tokens: int, compute: int, dense: bool = True) -> tuple[int, int]:
    """Of LoRA's change of one block's saved activations (lora_activation_delta; lora_op_level_delta under
    selective AC), the parts tensor parallelism splits, as the project's lora_styles splits the adapters: lora_A's
    outputs (tokens x rank) are whole on every tp rank (rowwise: summed over them), and so are the norms' outputs;
    split are what no longer is kept of this rank's heads and hidden units (Qwen3's q_norm / k_norm inputs,
    down_proj's input), the dropped-out inputs of the rowwise layers (o_proj, down_proj: their input split), and
    under selective AC the kept outputs of the colwise layers' base_layer and lora_B (q/k/v, gate/up). A routed
    block (not `dense`): its attention's only (read_lora adapts no expert)."""
    lora = model.lora
    if lora is None:
        return 0, 0
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q, "gate_proj": model.ffn_dim,
              "up_proj": model.ffn_dim, "down_proj": model.ffn_dim}  # fmt: skip
    paths = {name: f"model.layers.0.{'self_attn' if name in ATTENTION else 'mlp'}.{name}" for name in widths}
    adapted = {name for name in widths if lora_targets(paths[name], lora.targets)}
    block = -(q + kv) * compute if model.qk_norm else 0
    if dense and (lora.dropout > 0 or "down_proj" not in adapted):
        block -= compute * model.ffn_dim
    if lora.dropout > 0:
        block += (compute + 1) * sum(widths[name] for name in adapted & {"o_proj", "down_proj"})
    outputs: list[tuple[int, bool]] = []  # (width, split) of each matmul, in forward order
    for name in FORWARD_ORDER if dense else ATTENTION:
        split = name not in ("o_proj", "down_proj")  # colwise: base_layer's and lora_B's outputs split
        width = widths[name] if split else 0
        outputs += [(width, split), (0, False), (width, split)] if name in adapted else [(width, split)]
    kept = sum(width for width, _ in outputs[::2]) - (q + kv + model.ffn_dim * dense)  # less op_level_kept's split
    return tokens * block, compute * tokens * kept


def tp_share_saved(split: int, tp: int) -> int:
    """What a tp rank does not hold of `split` bytes that tensor parallelism splits: all but its 1/tp share."""
    return split - math.ceil(split / tp)


def activations_by_mode(request: PlanRequest, compute: int) -> dict[str, int]:
    """Each AC mode's activations per GPU (the plan shows them all, whichever is used), of a rank's local_seq_len
    tokens. An hf model's tensor parallelism is counted from its tp 1 figure (hf_tp_saving)."""
    model, batch, seq, chunks, every = (
        request.model,
        request.batch,
        request.local_seq_len,
        request.loss_chunks,
        request.ac_every,
    )
    hf = isinstance(model, HfShape)
    tp = 1 if hf else request.tp
    return {
        mode: activation_bytes(model, batch, seq, compute, mode, tp, chunks, request.ep, every)
        + family_activation_bytes(model, batch, seq, compute, mode, every)
        - (hf_tp_saving(model, batch, seq, compute, mode, request.tp, chunks, every) if hf else 0)
        for mode in AC_MODES
    }
