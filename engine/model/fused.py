"""A decoder-only base on the grouped kernels in one C++ call per forward (engine/model/kernels'
torch.classes.eagle_cpu.Decoder), the same bits as transformers' own forward (the draft head's twin is
engine/draft/fused.py).

A decoding step of a small model on the CPU runs ~40 ops in each of its 18 to 30 layers, and transformers' modules
spend more time in Python between them than the matmuls take. The Decoder, built once from the model's dimensions and
its weights by name (each checked then), runs the very ops transformers runs,
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

# The kernels' name of each projection of a layer (engine/model/kernels/weights.cpp names a layer's weights), and
# its module.
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's and Gemma 3's norms of q's and k's heads, where present: self_attn's


@dataclass(frozen=True)
class Family:
    """What the Decoder needs to know of a model family: the norms a layer has, by the kernels' names for where they
    sit (input_norm, post_attention_norm, pre_mlp_norm, post_mlp_norm) and their modules', their class, whether
    they scale by 1 + w (Gemma's) rather than by w, and the MLP's activation."""

    norms: dict[str, str]
    norm_class: str
    plus_one: bool
    activation: str


_PRE_NORMS = {"input_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
FAMILIES = {
    "llama": Family(_PRE_NORMS, "LlamaRMSNorm", False, "silu"),
    "qwen2": Family(_PRE_NORMS, "Qwen2RMSNorm", False, "silu"),
    "qwen3": Family(_PRE_NORMS, "Qwen3RMSNorm", False, "silu"),
    "gemma3_text": Family({"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                           "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"},
                          "Gemma3RMSNorm", True, "gelu_pytorch_tanh"),
}


class FusedDecoder:
    """The decoder of a model of FAMILIES whose every projection is a QuantLinear on one kernel, as one kernel call."""

    def __init__(self, model: PreTrainedModel):
        self.body = model.get_decoder()
        config = model.config.get_text_config()
        self.family = FAMILIES[config.model_type]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        attention = [layer.self_attn for layer in self.body.layers]
        self.window = sliding_window(model)
        # Gemma 3's sliding layers have rotary tables of their own; the others share one.
        self.layer_types = getattr(config, "layer_types", None) if config.model_type == "gemma3_text" else None
        self.int8 = attention[0].q_proj.int8
        dimensions = {"hidden": config.hidden_size, "heads": config.num_attention_heads, "kv_heads": self.kv_heads,
                      "head_dim": self.head_dim, "intermediate": config.intermediate_size}
        self.native = torch.classes.eagle_cpu.Decoder(
            dimensions, float(config.rms_norm_eps), float(attention[0].scaling),
            self.family.activation.startswith("gelu"), self.int8,
            [getattr(a, "sliding_window", None) is not None for a in attention], self._weights())

    @classmethod
    def of(cls, model: PreTrainedModel) -> FusedDecoder | None:
        """A FusedDecoder for `model` if the Decoder computes exactly what its transformers forward computes."""
        return cls(model) if why_not_fused(model) is None else None

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every weight by the kernels' name for it: the final norm, and layer i's under layers.<i>."""
        weights = {"final_norm": self._norm_weight(self.body.norm)}
        for index, layer in enumerate(self.body.layers):
            weights |= {f"layers.{index}.{name}": tensor for name, tensor in self._layer_weights(layer).items()}
        return weights

    def _layer_weights(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A layer's norms (those its family has, and q and k norms where present), then its projections."""
        norms = {name: layer.get_submodule(path) for name, path in self.family.norms.items()}
        norms |= {name: norm for name in QK_NORMS if (norm := getattr(layer.self_attn, name, None)) is not None}
        return {name: self._norm_weight(norm) for name, norm in norms.items()} | projection_weights(layer)

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        """A norm's weight as the Decoder multiplies by it: w, or 1 + w for Gemma's (as its forward adds them, in
        float32)."""
        weight = norm.weight.detach().float()
        return (1.0 + weight) if self.family.plus_one else weight.contiguous()

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
        hidden, features = self.native.forward(embeddings, (cos, sin, local_cos, local_sin), mask, sliding_mask,
                                               buffers, start, capture)
        for layer in layers:
            layer.length = start + rows
        return hidden, features


def projection_weights(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer's projections by the kernels' names (PROJECTIONS): each one's groups, and its bias where it has one."""
    weights = {}
    for name, path in PROJECTIONS.items():
        projection = layer.get_submodule(path)
        weights |= group_weights(name, projection)
        if projection.bias is not None:
            weights[f"{name}.bias"] = projection.bias
    return weights


def group_weights(name: str, linear: QuantLinear) -> dict[str, torch.Tensor]:
    """A QuantLinear's groups under `name`: its codes and scales, and its mins, block scales and block mins where it
    has them."""
    parts = {"codes": linear.codes, "scales": linear.scales, "mins": linear.mins, "block_scales": linear.block_scales,
             "block_mins": linear.block_mins}
    return {f"{name}.{part}": tensor for part, tensor in parts.items() if tensor is not None}


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
    """None if the Decoder describes `model` exactly, else what differs (checked in order, the kernel build
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
    modules = [layer.get_submodule(path) for layer in layers for path in PROJECTIONS.values()]
    if not all(isinstance(m, QuantLinear) for m in modules) or len({m.int8 for m in modules}) != 1:
        return False
    return not (modules[0].int8 and any(m.out_features % TILE for m in modules))


def _norms_of(layers, family: Family) -> bool:
    """Every norm the family puts in a layer is its RMSNorm class, and only those are there."""
    for layer in layers:
        for path in family.norms.values():
            if type(layer.get_submodule(path)).__name__ != family.norm_class:
                return False
        for name in QK_NORMS:
            norm = getattr(layer.self_attn, name, None)
            if norm is not None and type(norm).__name__ != family.norm_class:
                return False
    return True


def _layers(cache: GrowingCache, count: int) -> list[GrowingLayer]:
    """The cache's layers, created here on the first forward as transformers would create them."""
    while len(cache.layers) < count:
        cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers
