"""Causal self-attention that keeps packed documents apart (data.document_mask), for model.py.

Prepared data packs documents back to back into windows of training.seq_len tokens. With document ids
(data.MicroBatch.document_ids) a token attends only to earlier tokens of its own document, as it would if the
document ran alone; without them (synthetic data, data.document_mask false) attention is plain causal.

- GPU: FlexAttention (torch.nn.attention.flex_attention), compiled by torch.compile into one fused kernel, with
  a document-causal BlockMask: blocks of 128 x 128 that lie wholly outside every document are skipped, so packed
  documents cost less than the whole causal triangle, and no seq x seq mask is ever built (torchtitan does the
  same).
- CPU: F.scaled_dot_product_attention with a dense boolean (seq x seq per row) document-causal mask. FlexAttention
  has no backward on CPU in torch 2.13 ("FlexAttention does not support backward on CPU"); its eager forward
  equals the dense mask's to 6e-7. The dense mask costs seq^2 bytes per row, negligible at the sequence lengths
  CPU runs use.

`document_mask` builds the mask once per forward, from the document ids; `attention` applies it in each block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

Mask = BlockMask | torch.Tensor | None


def document_mask(document_ids: torch.Tensor | None) -> Mask:
    """The attention mask of (batch, seq) document ids: a BlockMask on CUDA, a dense (batch, 1, seq, seq) boolean
    mask elsewhere (True: may attend); None (plain causal attention) without document ids."""
    if document_ids is None:
        return None
    batch, seq_len = document_ids.shape
    if document_ids.device.type == "cuda":
        return compiled_create_block_mask()(
            document_causal(document_ids), batch, None, seq_len, seq_len, device=document_ids.device
        )
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def document_causal(document_ids: torch.Tensor) -> Callable:
    """FlexAttention's mask_mod: query q of row `batch` may see key kv of its own document at or before it."""

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (document_ids[batch, q] == document_ids[batch, kv]) & (kv <= q)

    return mask_mod


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) q, k, v within the documents of `mask` (document_mask's)."""
    if mask is None:
        # F.scaled_dot_product_attention is looked up here, at call time: context parallelism replaces it at
        # dispatch, which a reference bound at import would bypass.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    if isinstance(mask, BlockMask):
        return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


# Compiled once per process, on first use (torchtitan does the same). Uncompiled, flex_attention computes every
# score of the seq x seq matrix and create_block_mask evaluates mask_mod for every pair of tokens.
@functools.cache
def compiled_flex_attention() -> Callable:
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def compiled_create_block_mask() -> Callable:
    return torch.compile(create_block_mask)
