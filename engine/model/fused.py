"""A Llama base on the q4 kernels in one C++ call per forward (engine/model/kernels llama_forward), the same bits as
transformers' own forward (the draft head's twin is engine/draft/fused.py).

A decoding step of a small model on the CPU runs ~40 ops in each of its 30 layers, and transformers' modules spend
more time in Python between them than the q4 matmuls take. llama_forward runs the very ops transformers runs, in the
same order on the same kernels (Q4_1 linear layers, fixed-order attention; norms, rotary and the residual stream by
hand, each step rounded as torch rounds it, around torch's own mean and SiLU), so hidden states, features and cache
come out bit for bit as through the model (tests/test_fused.py), and plain decoding and EAGLE still run one model.
Models it does not describe exactly keep transformers' forward.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from . import kernels
from .attention import FIXED_ORDER
from .cache import GrowingCache, GrowingLayer
from .quant import TILE, QuantLinear

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
MATMULS = (PROJECTIONS[:3], PROJECTIONS[3:4], PROJECTIONS[4:6], PROJECTIONS[6:])  # llama_forward's, per layer


class FusedLlama:
    """The decoder of a Llama model whose every projection is a bias-free Q4_1 QuantLinear, as one kernel call."""

    def __init__(self, model: PreTrainedModel):
        self.body = model.get_decoder()
        config = model.config.get_text_config()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.eps = float(config.rms_norm_eps)
        self.scale = float(self.body.layers[0].self_attn.scaling)
        self.weights = torch.classes.eagle_cpu.Weights(
            [tensor for layer in self.body.layers for tensor in _layer_tensors(layer)])
        self.int8 = self.body.layers[0].self_attn.q_proj.int8

    @classmethod
    def of(cls, model: PreTrainedModel) -> FusedLlama | None:
        """A FusedLlama for `model` if llama_forward computes exactly what its transformers forward computes."""
        return cls(model) if why_not_fused(model) is None else None

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
        cos, sin = self.body.rotary_emb(embeddings, positions)
        layers = _layers(cache, len(self.body.layers))
        like = embeddings.new_empty(1, self.kv_heads, 0, self.head_dim)  # what update would get for its keys
        buffers = [buffer for layer in layers for buffer in layer.reserve(start + rows, like, like)]
        hidden, *features = torch.ops.eagle_cpu.llama_forward(
            embeddings, cos, sin, mask, self.weights, buffers, self.body.norm.weight, start, self.head_dim, self.eps,
            self.scale, capture, self.int8)
        for layer in layers:
            layer.length = start + rows
        return hidden, features


def why_not_fused(model: PreTrainedModel) -> str | None:
    """None if llama_forward describes `model` exactly, else what differs (checked in order, the kernel build last)."""
    config = model.config.get_text_config()
    layers = getattr(model.get_decoder(), "layers", [])
    checks = (
        (lambda: config.model_type == "llama", f"model type {config.model_type!r} (llama_forward is Llama's forward)"),
        (lambda: getattr(config, "hidden_act", None) == "silu", "an activation other than SiLU"),
        (lambda: config._attn_implementation == FIXED_ORDER, "attention other than the fixed-order kernel"),
        (lambda: not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False), "biases"),
        (lambda: bool(layers) and _on_q4_groups(layers), "layers not all on Q4_1 groups of one kernel"),
        (lambda: model.dtype == torch.float32, f"{model.dtype} weights"),
        (kernels.available, "engine/model/kernels unavailable"),
    )
    return next((reason for holds, reason in checks if not holds()), None)


def _on_q4_groups(layers) -> bool:
    """Every projection a bias-free Q4_1 QuantLinear, all on the same kernel (int8 or not), and transformers'
    RMSNorm."""
    modules = [layer.get_submodule(name) for layer in layers for name in PROJECTIONS]
    return stackable(modules, "Q4_1") and all(
        type(norm).__name__ == "LlamaRMSNorm" for layer in layers
        for norm in (layer.input_layernorm, layer.post_attention_layernorm))


def stackable(modules: list, kind: str) -> bool:
    """Bias-free QuantLinears of `kind`, all int8 or none; int8 ones in whole tiles, so that stacking keeps every
    projection's features where the kernel call's output puts them."""
    if not all(isinstance(m, QuantLinear) and m.kind == kind and m.bias is None for m in modules):
        return False
    return len({m.int8 for m in modules}) == 1 and not (modules[0].int8 and any(m.out_features % TILE for m in modules))


def _layer_tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    """llama_forward's tensors for one layer: its norms, then the groups of q, k and v as one matmul, o, gate and up
    as one, down (fewer, larger calls: each output feature is computed as in its own projection, so the same bits)."""
    tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    for names in MATMULS:
        tensors += stacked([layer.get_submodule(name) for name in names])
    return tensors


def stacked(projections: list[QuantLinear]) -> list[torch.Tensor]:
    """The groups of projections that take the same input (codes, scales and, for Q4_1, mins), stacked by output
    feature; the projections' own buffers become views of them, so the weights are held once."""
    parts = ("codes", "scales", "mins") if projections[0].kind == "Q4_1" else ("codes", "scales")
    if len(projections) == 1:
        return [getattr(projections[0], part) for part in parts]
    merged = [torch.cat([getattr(p, part) for p in projections]) for part in parts]
    start = 0
    for projection in projections:  # by features, or by tiles of them on int8 kernels: the buffers' first dimension
        end = start + len(projection.codes)
        for part, tensor in zip(parts, merged):
            setattr(projection, part, tensor[start:end])
        start = end
    return merged


def _layers(cache: GrowingCache, count: int) -> list[GrowingLayer]:
    """The cache's layers, created here on the first forward as transformers would create them."""
    while len(cache.layers) < count:
        cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers
