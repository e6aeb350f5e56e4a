"""Attention that gives every query row the same bits whatever else shares the forward, for exact verification.

Greedy speculative decoding is lossless only if the forward that verifies a tree scores each node exactly as
one-token decoding scores the same token. torch's CPU attention kernels sum over keys in an order that depends on how
many queries and keys a call has, and a tree puts a node's ancestors at other key positions than decoding does (with
masked siblings in between). In float32 that moves outputs by ~1e-5, enough to flip a greedy choice between two
near-tied tokens now and then; in bfloat16 it changes a result by a whole bf16 step in most rounds.

Two ways out. wide_attention runs the score, softmax and value sums in float64: whatever the order, they agree to
~1e-16 relative, far below the float32 or bfloat16 rounding of the output, so the rows come out bit-identical
(unless an exact result falls within ~1e-16 of a rounding boundary); its float64 copies of the cache make it cost
more as the context grows. fixed_order_attention (float32 models, engine/model/kernels) gathers the keys a row sees in key
order and sums them in one fixed order in float32, so a row's bits depend on what it sees and nothing else. With
linear layers that compute each row alike for any batch (engine.model.packed, engine.model.quant), this makes a whole CPU
forward batch-invariant.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from . import kernels

NAME = "eagle_wide"
FIXED_ORDER = "eagle_fixed_order"  # float32 models with engine/model/kernels built


def wide_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: query [B, H, M, D], key/value [B, Hkv, L, D], an additive (or
    bool) mask [B, 1 or H, M, >=L] or None (causal). Returns [B, M, H, D] in the query's dtype."""
    _refuse_unsupported(kwargs)
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    wide = torch.float64
    # Query heads that share a key/value head become extra rows of one product (grouped-query attention).
    scores = query.to(wide).reshape(batch, kv_heads, groups * rows, dim) @ key.to(wide).transpose(-1, -2)
    scores = scores.view(batch, kv_heads, groups, rows, length) * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[..., :length]
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.view(mask.shape[0], kv_heads, groups, rows, length)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(wide)
    elif rows > 1:
        visible = torch.ones(rows, length, dtype=torch.bool, device=query.device).tril(length - rows)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * rows, length)
    out = (probs @ value.to(wide)).view(batch, heads, rows, dim)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def fixed_order_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """wide_attention's contract in float32 without the float64 copies of the cache that grow with the context:
    engine/model/kernels sums each row's visible keys in key order (masked keys skipped), so a row's bits depend only on
    what it sees. Same shapes as wide_attention; the mask must be shared by the heads ([B, 1, M, >=L])."""
    _refuse_unsupported(kwargs)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(torch.float32).min)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.eagle_cpu.attention(query, key, value, attention_mask, scale), None


def _refuse_unsupported(kwargs: dict) -> None:
    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"the CPU engine's attention does not implement {unsupported!r}; load with pack=False")


for _name, _function in ((NAME, wide_attention), (FIXED_ORDER, fixed_order_attention)):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, eager_mask)


def use_wide_attention(model: PreTrainedModel) -> bool:
    """Switch a model that runs wholly on the CPU to a batch-invariant attention (fixed_order_attention for float32
    where engine/model/kernels build: faster, and it does not grow with the context as the float64 copies do;
    wide_attention otherwise); True if it now uses one. Models elsewhere keep their attention (GPU kernels round
    differently again), and so do models that cannot change it after loading."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    name = FIXED_ORDER if model.dtype == torch.float32 and kernels.available() else NAME
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name
