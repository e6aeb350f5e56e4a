"""A decoder-only base on the grouped kernels in one C++ call per forward (engine/model/kernels decoder_forward), the
same bits as transformers' own forward (the draft head's twin is engine/draft/fused.py).

A decoding step of a small model on the CPU runs ~40 ops in each of its 18 to 30 layers, and transformers' modules
spend more time in Python between them than the matmuls take. decoder_forward runs the very ops transformers runs,
in the same order on the same kernels (grouped linear layers, fixed-order attention; norms, rotary and the residual
stream by hand, each step rounded as torch rounds it, around torch's own mean, SiLU and GELU), so hidden states,
features and cache come out bit for bit as through the model (tests/test_fused.py), and plain decoding and EAGLE
still run one model. It describes the Llama, Qwen2, Qwen3 and Gemma 3 families (FAMILIES); models it does not
describe exactly keep transformers' forward, and why_not_fused says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from . import kernels
from .attention import FIXED_ORDER
from .cache import GrowingCache, GrowingLayer
from .quant import TILE, QuantLinear

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Family:
    """What decoder_forward needs to know of a model family: which norms a layer has where (input, after attention,
    before the MLP, after the MLP; None: none there), their class, whether they scale by 1 + w (Gemma's) rather
    than by w, and the MLP's activation."""

    norms: tuple[str | None, str | None, str | None, str | None]
    norm_class: str
    plus_one: bool
    activation: str


_PRE_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
FAMILIES = {
    "llama": Family(_PRE_NORMS, "LlamaRMSNorm", False, "silu"),
    "qwen2": Family(_PRE_NORMS, "Qwen2RMSNorm", False, "silu"),
    "qwen3": Family(_PRE_NORMS, "Qwen3RMSNorm", False, "silu"),
    "gemma3_text": Family(("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"), "Gemma3RMSNorm", True, "gelu_pytorch_tanh"),
}


class FusedDecoder:
    """The decoder of a model of FAMILIES whose every projection is a QuantLinear on one kernel, as one kernel call."""

    def __init__(self, model: PreTrainedModel):
        self.body = model.get_decoder()
        config = model.config.get_text_config()
        self.family = FAMILIES[config.model_type]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.eps = float(config.rms_norm_eps)
        attention = [layer.self_attn for layer in self.body.layers]
        self.scale = float(attention[0].scaling)
        self.sliding = [int(getattr(a, "sliding_window", None) is not None) for a in attention]
        self.window = sliding_window(model)
        # Gemma 3's sliding layers have rotary tables of their own; the others share one.
        self.layer_types = getattr(config, "layer_types", None) if config.model_type == "gemma3_text" else None
        self.weights = torch.classes.eagle_cpu.Weights(
            [tensor for layer in self.body.layers for tensor in self._layer_tensors(layer)])
        self.final_norm = self._norm_weight(self.body.norm)
        self.int8 = attention[0].q_proj.int8
        self.gelu = self.family.activation.startswith("gelu")

    @classmethod
    def of(cls, model: PreTrainedModel) -> FusedDecoder | None:
        """A FusedDecoder for `model` if decoder_forward computes exactly what its transformers forward computes."""
        return cls(model) if why_not_fused(model) is None else None

    def _norm_weight(self, norm: torch.nn.Module | None) -> torch.Tensor:
        """A norm's weight as decoder_forward multiplies by it: w, or 1 + w for Gemma's (as its forward adds them,
        in float32); an empty tensor where the layer has no norm there."""
        if norm is None:
            return torch.empty(0)
        weight = norm.weight.detach().float()
        return (1.0 + weight) if self.family.plus_one else weight.contiguous()

    def _layer_tensors(self, layer: torch.nn.Module) -> list[torch.Tensor]:
        """decoder_forward's tensors for one layer: its four norms and q and k norms, then its projections'."""
        norms = [getattr(layer, name) if name else None for name in self.family.norms]
        norms += [getattr(layer.self_attn, name, None) for name in ("q_norm", "k_norm")]
        return layer_tensors([self._norm_weight(norm) for norm in norms], layer)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: GrowingCache, positions: torch.Tensor | None, mask: torch.Tensor | None,
        capture: list[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [1, M] after the cache's positions; positions [1, M] (None: consecutive) and mask as Target passes
        them to the model. Returns final-norm hidden states [1, M, E] and the inputs of the `capture` layers."""
        start, rows = cache.get_seq_length(), ids.shape[1]
        if positions is None:
            positions = torch.arange(start, start + rows).view(1, -1)
        embeddings = self.body.embed_tokens(ids)
        if self.layer_types:
            (cos, sin), (local_cos, local_sin) = (self.body.rotary_emb(embeddings, positions, kind)
                                                  for kind in ("full_attention", "sliding_attention"))
        else:
            (cos, sin), local_cos, local_sin = self.body.rotary_emb(embeddings, positions), None, None
        sliding_mask = None if self.window is None else window_mask(mask, start, positions[0], self.window)
        layers = _layers(cache, len(self.body.layers))
        like = embeddings.new_empty(1, self.kv_heads, 0, self.head_dim)  # what update would get for its keys
        buffers = [buffer for layer in layers for buffer in layer.reserve(start + rows, like, like)]
        hidden, *features = torch.ops.eagle_cpu.decoder_forward(
            embeddings, cos, sin, local_cos, local_sin, mask, sliding_mask, self.weights, buffers, self.final_norm,
            start, self.head_dim, self.eps, self.scale, capture, self.int8, self.sliding, self.gelu)
        for layer in layers:
            layer.length = start + rows
        return hidden, features


def layer_tensors(norms: list[torch.Tensor | None], layer: torch.nn.Module) -> list[torch.Tensor]:
    """A layer as decoder_forward (and eagle3_head) take it: the weights of its six norms as the kernel multiplies by
    them (None or empty: no norm there), then each projection's groups and bias (empty tensors where absent)."""
    tensors = [torch.empty(0) if norm is None else norm for norm in norms]
    for name in PROJECTIONS:
        projection = layer.get_submodule(name)
        tensors += linear_tensors(projection) + [torch.empty(0) if projection.bias is None else projection.bias]
    return tensors


def linear_tensors(linear: QuantLinear) -> list[torch.Tensor]:
    """A QuantLinear's groups as the kernels take a linear layer: codes, scales, mins, block scales, block mins
    (empty tensors where absent)."""
    parts = (linear.codes, linear.scales, linear.mins, linear.block_scales, linear.block_mins)
    return [torch.empty(0) if part is None else part for part in parts]


def sliding_window(model: PreTrainedModel) -> int | None:
    """How far back the model's sliding-window layers see (Gemma 3's local layers); None where every layer sees the
    whole context."""
    layers = getattr(model.get_decoder(), "layers", [])
    windows = (getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in layers)
    return next((window for window in windows if window), None)


def window_mask(mask: torch.Tensor | None, start: int, positions: torch.Tensor, window: int) -> torch.Tensor | None:
    """The mask of a sliding-window layer: `mask` (an additive float [1, 1, M, start + M], or None: causal), with
    the keys `window` or more positions behind a row hidden, as a one-token step at that row's position hides them
    (cache entries before `start` sit at their own positions, this call's at `positions`); None when no row reaches
    that far (the mask itself then)."""
    rows = positions.shape[0]
    if int(positions.max()) < window:
        return mask
    key_positions = torch.cat([torch.arange(start, device=positions.device), positions])
    far = key_positions[None, :] <= positions[:, None] - window
    if mask is None:
        mask = torch.zeros(1, 1, rows, start + rows, device=positions.device)
        causal = torch.ones(rows, start + rows, dtype=torch.bool, device=positions.device).tril(start)
        mask.masked_fill_(~causal, torch.finfo(torch.float32).min)
    return mask.masked_fill(far[None, None], torch.finfo(mask.dtype).min)


def why_not_fused(model: PreTrainedModel) -> str | None:
    """None if decoder_forward describes `model` exactly, else what differs (checked in order, the kernel build
    last)."""
    config = model.config.get_text_config()
    family = FAMILIES.get(config.model_type)
    layers = getattr(model.get_decoder(), "layers", [])
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    checks = (
        (lambda: family is not None,
         f"model type {config.model_type!r} (the fused forward describes {', '.join(FAMILIES)})"),
        (lambda: activation == family.activation, f"activation {activation!r}"),
        (lambda: config._attn_implementation == FIXED_ORDER, "attention other than the fixed-order kernel"),
        (lambda: not getattr(config, "mlp_bias", False), "MLP biases"),
        (lambda: getattr(config, "attn_logit_softcapping", None) is None, "attention logit softcapping"),
        (lambda: not getattr(config, "use_bidirectional_attention", False), "bidirectional attention"),
        (lambda: bool(layers) and on_groups(layers), "layers not all on grouped layers of one kernel"),
        (lambda: _norms_of(layers, family), f"norms other than {family.norm_class if family else ''}"),
        (lambda: model.dtype == torch.float32, f"{model.dtype} weights"),
        (kernels.available, "engine/model/kernels unavailable"),
    )
    return next((reason for holds, reason in checks if not holds()), None)


def on_groups(layers) -> bool:
    """Every projection a QuantLinear, all on the same kernel (int8 or not), int8 ones in whole tiles so that each
    projection's features sit where the kernel call's output puts them."""
    modules = [layer.get_submodule(name) for layer in layers for name in PROJECTIONS]
    if not all(isinstance(m, QuantLinear) for m in modules) or len({m.int8 for m in modules}) != 1:
        return False
    return not (modules[0].int8 and any(m.out_features % TILE for m in modules))


def _norms_of(layers, family: Family) -> bool:
    """Every norm the family puts in a layer is its RMSNorm class, and only those are there."""
    for layer in layers:
        for name in family.norms:
            if name is not None and type(getattr(layer, name)).__name__ != family.norm_class:
                return False
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, name, None)
            if norm is not None and type(norm).__name__ != family.norm_class:
                return False
    return True


def _layers(cache: GrowingCache, count: int) -> list[GrowingLayer]:
    """The cache's layers, created here on the first forward as transformers would create them."""
    while len(cache.layers) < count:
        cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers
