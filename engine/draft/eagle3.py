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


def _attention(config: HeadConfig) -> Attention:
    """Attention over [embedding, hidden] with heads of config.head_dim, which may differ from hidden / heads (as in
    SpecForge's gpt-oss heads): q, k, v are as wide as the heads, o_proj maps them back to hidden_size."""
    h, heads = config.hidden_size, config.num_attention_heads
    width = heads * config.attention_head_dim
    attention = Attention(2 * h, width, heads, config.num_key_value_heads, config.qkv_bias)
    if width != h:
        attention.o_proj = nn.Linear(width, h, bias=False)
    return attention


class Eagle3Layer(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _attention(config)
        self.mlp = MLP(h, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, rope: KV, past: KV | None, mask: torch.Tensor | None):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn, kv = self.self_attn(x, rope, past, mask)
        # The official head adds the un-normalised hidden back; speculators' norm_before_residual adds the normed one.
        hidden = (normed if self.norm_before_residual else hidden) + attn
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
        """The layers the checkpoint's config names, else the official capture's."""
        return list(self.config.target_layers or fused_layers(num_target_layers))

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
