"""EAGLE-3 head: fused low/mid/high target features, one decoder layer on [norm(embedding), norm(hidden)],
its own LM head over a reduced draft vocabulary mapped back to base ids by `d2t`."""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .head import DraftHead
from .layers import KV, MLP, Attention, RMSNorm


def fused_layers(num_target_layers: int) -> list[int]:
    """Base decoder layers whose inputs are fused (low, mid, high), as the official capture picks them."""
    n = num_target_layers
    return [2, n // 2, n - 3]


class Eagle3Layer(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(2 * h, h, config.num_attention_heads, config.num_key_value_heads, config.qkv_bias)
        self.mlp = MLP(h, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, embeds, hidden, rope: KV, past: KV | None, mask: torch.Tensor | None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, kv = self.self_attn(x, rope, past, mask)
        hidden = hidden + attn  # the residual is the un-normalised hidden, as in the official head
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), kv


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
        if config.draft_vocab != config.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def has_vocab_map(self) -> bool:
        return hasattr(self, "d2t")

    def feature_layers(self, num_target_layers: int) -> list[int]:
        return fused_layers(num_target_layers)

    def forward(self, hidden, token_ids, positions, past, mask, from_target):
        hidden = hidden.to(self.fc.weight.dtype)
        if from_target:
            hidden = self.fc(hidden)
        layer_past = None if past is None else past[0]
        out, kv = self.midlayer(self.embed(token_ids), hidden, self.rope(positions), layer_past, mask)
        return out, [kv]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.has_vocab_map else draft_ids

    def set_vocab(self, used_target_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: `used_target_ids` are the kept base ids, any order."""
        used = used_target_ids.sort().values.to(self.d2t.device)
        self.d2t.copy_(used - torch.arange(len(used), device=used.device))
        self.t2d.zero_()
        self.t2d[used] = True
