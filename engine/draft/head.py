"""What every draft head shares: token embedding (borrowed from the base model), RoPE, and the call signature."""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .layers import KV, Rotary


class DraftHead(nn.Module):
    """Base class of the EAGLE-1 and EAGLE-3 heads.

    The token embedding (and, for EAGLE-1, the LM head) belong to the base model. They are borrowed, not copied,
    unless the checkpoint ships its own embedding, so a head costs only its own layers in memory.
    """

    kind: str

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(config.attention_head_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens: nn.Embedding | None = None
        self._base: tuple[nn.Module, ...] = ()  # in a tuple: not a submodule, not in the state dict

    @property
    def layout(self) -> str:
        """The checkpoint layout the head was read from: "official", "specforge" or "speculators"."""
        return self.config.layout

    def attach(self, base_model: nn.Module) -> None:
        """Borrow the base model's input embedding and LM head. They are looked up at each use, so the head keeps
        using the base model's own even after its layers are replaced in place (engine/model/packed.py)."""
        self._base = (base_model,)

    def base_lm_head(self) -> nn.Module:
        return self._base[0].get_output_embeddings()

    def embedding(self) -> nn.Module:
        """The token embedding the head uses: its own if the checkpoint ships one, else the base model's."""
        return self.embed_tokens if self.embed_tokens is not None else self._base[0].get_input_embeddings()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding()(token_ids).to(self.fc.weight.dtype)

    def rope(self, positions: torch.Tensor) -> KV:
        return self.rotary(positions, self.fc.weight.dtype)

    def feature_layers(self, num_target_layers: int) -> list[int] | None:
        """Decoder layers whose *inputs* the head reads (EAGLE-3), or None for the final-norm output (EAGLE-1)."""
        return None

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        past: list[KV] | None,
        mask: torch.Tensor | None,
        from_target: bool,
    ) -> tuple[torch.Tensor, list[KV]]:
        """One draft step over T slots: slot p pairs a hidden state with the token that follows it.

        hidden: [B, T, feature_size] target features (from_target) or [B, T, H] the head's own earlier outputs.
        Returns the new hidden states [B, T, H] and the keys/values this call added, one pair per layer.
        """
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary."""
        raise NotImplementedError

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to base-model ids."""
        return draft_ids
