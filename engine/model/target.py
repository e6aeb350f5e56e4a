"""The base model seen by the decoding loop: one forward over new tokens with explicit positions and mask,
returning final-norm hidden states and the features a draft head reads, through the unmodified HF model."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .cache import GrowingCache
from .fused import FusedDecoder, sliding_window, window_mask
from .quant import kv_dtype


class Target:
    """Wraps a Hugging Face causal LM; the LM head is applied separately so callers pay only for rows they need."""

    def __init__(self, model: PreTrainedModel, feature_layers: list[int] | None = None, fused: bool = True):
        """fused: run the decoder as one kernel call where engine.model.fused describes the model exactly (same bits)."""
        self.model = model
        self.fused = FusedDecoder.of(model) if fused else None
        self.body = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.config = model.config.get_text_config()
        self.max_context = getattr(self.config, "max_position_embeddings", None) or 2048
        self.window = sliding_window(model)
        self.kv_dtype = kv_dtype(model)  # fixed once the engine has chosen kernels and attention, as `fused` is
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self.set_feature_layers(feature_layers)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def set_feature_layers(self, layers: list[int] | None) -> None:
        """Capture the inputs of these decoder layers (EAGLE-3) on every forward; None: final-norm output only."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.feature_layers = [], layers
        for index in layers or []:
            layer = self.body.layers[index]
            self._hooks.append(layer.register_forward_pre_hook(self._capture(index), with_kwargs=True))

    def _capture(self, index: int):
        def hook(module, args, kwargs):
            self._captured[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def new_cache(self) -> GrowingCache:
        return GrowingCache(self.kv_dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: GrowingCache,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the decoder over input_ids [T] appended to `cache`.

        positions [T] default to consecutive ones after the cache; mask is a bool [T, cache+T] visibility matrix
        (None: causal). Returns final-norm hidden states [T, H] and head features [T, F].
        """
        ids = input_ids.view(1, -1).to(self.device, non_blocking=True)
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device)
            bias.masked_fill_(~mask.to(self.device, non_blocking=True), torch.finfo(bias.dtype).min)
            mask = bias[None, None]
        if positions is not None:
            positions = positions.view(1, -1).to(self.device, non_blocking=True)
        if self.fused is not None:
            hidden, captured = self.fused.forward(ids, cache, positions, mask, self.feature_layers or [])
            hidden = hidden[0]
        else:
            out = self.body(input_ids=ids, position_ids=positions, attention_mask=self._masks(mask, cache, positions),
                            past_key_values=cache, use_cache=True)
            hidden = out.last_hidden_state[0]
            captured = [self._captured.pop(i) for i in self.feature_layers or []]
        if not self.feature_layers:
            return hidden, hidden
        # With --device auto the captured layers may sit on different GPUs: gather them beside the LM head.
        return hidden, torch.cat([layer_input[0].to(hidden.device) for layer_input in captured], dim=-1)

    def _masks(self, mask: torch.Tensor | None, cache: GrowingCache, positions: torch.Tensor | None):
        """The mask as the model takes it: for a model with sliding-window layers, a tree's mask for its full layers
        and, for its sliding ones, the same with the keys out of the window hidden (transformers would use a given
        mask as it is in both, and a tree row would see keys its one-token step does not)."""
        if mask is None or self.window is None:
            return mask
        start, rows = cache.get_seq_length(), mask.shape[-2]
        at = positions[0] if positions is not None else torch.arange(start, start + rows, device=mask.device)
        return {"full_attention": mask, "sliding_attention": window_mask(mask, start, at, self.window)}

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2's, applied as its forward applies it
        return logits if cap is None else torch.tanh(logits / cap) * cap
