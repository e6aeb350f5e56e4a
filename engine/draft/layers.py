"""Building blocks shared by the EAGLE-1 and EAGLE-3 heads: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Attention takes the keys and values of earlier positions plus an explicit boolean mask, so one module serves
causal prefill, draft-tree expansion (siblings at one position, each seeing only its ancestors) and the
training-time-test unroll, whose masks differ only in shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KV = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding; `scaling` is the linear position-interpolation factor (1 = none)."""

    def __init__(self, head_dim: int, theta: float, scaling: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> KV:
        """cos and sin of shape [..., T, head_dim] for integer positions [..., T]."""
        angles = (positions.float() / self.scaling)[..., None] * self.inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(in_dim, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, rope: KV, past: KV | None, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, KV]:
        """x: [B, T, in]; past: keys/values [B, kv_heads, S, hd]; mask: bool [B|1, 1, T, S+T] (True = visible).

        Returns the output [B, T, hidden] and this call's own keys/values (for the caller to keep or drop).
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = (r.unsqueeze(1) if r.dim() == 3 else r for r in rope)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        out = attend(q, keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, H, T, hd] over keys/values [B, kv_heads, S, hd] that query heads share in groups; mask: None or
    bool [B|1, 1, T, S].

    CUDA's fused kernels take a mask or grouped heads, not both: given both, SDPA falls back to the math kernel and
    its float32 [B, H, T, S] scores (4 GiB for a 4 k-token prompt with 32 heads). With a mask, the query heads that
    share a key/value head become extra rows of one attention over it instead, the mask repeated for each: no copy of
    the keys, and on the CPU as fast as before.
    """
    batch, heads, rows, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if mask is None or groups == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=groups > 1)
    if mask.shape[1] != 1:
        raise ValueError(f"the head's attention mask is shared by its heads: [B|1, 1, T, S], got {list(mask.shape)}")
    grouped = q.reshape(batch, kv_heads, groups * rows, dim)
    mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).flatten(2, 3)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return out.view(batch, heads, rows, dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
