"""EAGLE-1 head: fc over [token embedding, final-norm feature], Llama decoder layers, the base LM head."""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .head import DraftHead
from .layers import KV, MLP, Attention, RMSNorm


class Eagle1Layer(nn.Module):
    """A Llama decoder layer; the first has no input norm because its input is already a normed feature."""

    def __init__(self, config: HeadConfig, index: int):
        super().__init__()
        h = config.hidden_size
        if index > 0:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(h, h, config.num_attention_heads, config.num_key_value_heads, config.qkv_bias)
        self.mlp = MLP(h, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: KV, past: KV | None, mask: torch.Tensor | None):
        normed = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        attn, kv = self.self_attn(normed, rope, past, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Eagle1Head(DraftHead):
    kind = "eagle1"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList(Eagle1Layer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, hidden, token_ids, positions, past, mask, from_target):
        x = self.fc(torch.cat([self.embed(token_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        rope = self.rope(positions)
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, rope, None if past is None else past[i], mask)
            new_kv.append(kv)
        return x, new_kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.base_lm_head()
        return lm_head(hidden.to(lm_head.weight.dtype))
