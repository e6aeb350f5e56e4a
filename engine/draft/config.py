"""The draft head's config.json: the official EAGLE layout (a Llama config with a few extra fields), and the
layouts other projects publish heads in, read into the same fields.

  official     the EAGLE authors' repositories: a flat Llama config; EAGLE-3 adds draft_vocab_size (and, in vLLM's
               reading, an optional top-level eagle_aux_hidden_state_layer_ids)
  specforge    SpecForge / SGLang EAGLE-3 heads: architectures ["LlamaForCausalLMEagle3"], the fused layers under
               eagle_config.eagle_aux_hidden_state_layer_ids, numbered as layer outputs (SGLang captures id + 1)
  speculators  vLLM speculators heads (Eagle3Speculator, EagleSpeculator): the decoder layer's Llama config under
               transformer_layer_config, the head's own fields at the top, fused layers numbered as layer inputs

The engine numbers fused layers as the decoder layers whose *inputs* it captures (engine/model/target.py), as vLLM
and speculators do; SpecForge's ids are shifted by one into that numbering.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AUX_LAYERS = "eagle_aux_hidden_state_layer_ids"  # the fused layers' field, in SGLang's, vLLM's and speculators' configs
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_SPECFORGE_ARCHITECTURE = "LlamaForCausalLMEagle3"
_SPECULATORS_KINDS = {"eagle3": "eagle3", "eagle": "eagle1"}


@dataclass
class HeadConfig:
    kind: str  # "eagle1" or "eagle3"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0  # linear factor
    fc_bias: bool = True  # EAGLE-1 only: the official `bias` field
    qkv_bias: bool = False
    draft_vocab_size: int | None = None  # EAGLE-3 only; None: the base vocabulary
    target_hidden_size: int | None = None  # EAGLE-3 only; defaults to hidden_size
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    target_layers: list[int] | None = None  # EAGLE-3 only: base layers whose inputs are fused; None: fused_layers()
    norm_before_residual: bool = False  # EAGLE-3 only: the residual is the normed hidden (speculators' option)
    layout: str = "official"  # the layout config.json was read from: official, specforge or speculators
    extra: dict[str, Any] = field(default_factory=dict)  # other fields, written back unchanged

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads: H_t for EAGLE-1, one H_t per fused layer (3) for EAGLE-3."""
        target = self.target_hidden_size or self.hidden_size
        return len(self.target_layers or range(3)) * target if self.kind == "eagle3" else target

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], kind: str, layout: str = "official") -> "HeadConfig":
        """Fields in the official layout's names (layout_fields translates the others); ValueError names a field
        that is missing or set to something the head modules do not compute."""
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"head config.json lacks {', '.join(missing)}")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or ({} if _rope_type(rope) in ("default", None) else rope)
        if scaling and _rope_type(scaling) not in ("linear", "default", None):
            raise ValueError(f"unsupported rope_scaling {scaling} in head config (only linear is supported)")
        _check_head_shape(raw, kind)
        known = {
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "bias", "qkv_bias",
            "draft_vocab_size", "target_hidden_size", "head_dim", "norm_before_residual", AUX_LAYERS,
        }
        return cls(
            kind=kind,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            num_hidden_layers=raw.get("num_hidden_layers", 1),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rope_scaling=float(scaling.get("factor", 1.0)),
            fc_bias=raw.get("bias", True),
            qkv_bias=raw.get("qkv_bias", False),
            draft_vocab_size=raw.get("draft_vocab_size") if kind == "eagle3" else None,
            target_hidden_size=raw.get("target_hidden_size"),
            head_dim=raw.get("head_dim"),
            target_layers=_layer_ids(raw.get(AUX_LAYERS), AUX_LAYERS) if kind == "eagle3" else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)) if kind == "eagle3" else False,
            layout=layout,
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            **self.extra,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
        }
        if self.rope_scaling != 1.0:
            raw["rope_scaling"] = {"type": "linear", "factor": self.rope_scaling}
        if self.qkv_bias:
            raw["qkv_bias"] = True
        if self.kind == "eagle1":
            raw["bias"] = self.fc_bias
        else:
            raw["draft_vocab_size"] = self.draft_vocab
            if self.target_hidden_size:
                raw["target_hidden_size"] = self.target_hidden_size
            if self.target_layers:
                raw[AUX_LAYERS] = list(self.target_layers)  # as layer inputs, vLLM's numbering
            if self.norm_before_residual:
                raw["norm_before_residual"] = True
        if self.head_dim:
            raw["head_dim"] = self.head_dim
        return raw


def detect_layout(raw: dict[str, Any]) -> str:
    """Which project wrote config.json, told from its fields alone (never from the folder's name)."""
    if any(k in raw for k in ("speculators_model_type", "speculators_config", "transformer_layer_config")):
        return "speculators"
    if _SPECFORGE_ARCHITECTURE in (raw.get("architectures") or []) or isinstance(raw.get("eagle_config"), dict):
        return "specforge"
    return "official"


def layout_fields(raw: dict[str, Any], layout: str) -> tuple[dict[str, Any], str | None]:
    """config.json's fields under the official layout's names, and the head kind where the layout states it (None:
    the tensor names tell). ValueError names a missing field or a setting the head modules do not compute."""
    if layout == "speculators":
        return _speculators_fields(raw)
    if layout == "specforge":
        return _specforge_fields(raw), "eagle3"
    return raw, None


def _specforge_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The official fields plus eagle_config; SGLang captures the input of layer id + 1 for each of its ids."""
    _refuse(raw, [("fc_norm", True, "an RMSNorm on each fused layer before fc (EAGLE-3.1)"),
                  ("norm_output", False, "logits from the un-normed hidden state"),
                  ("bias", True, "a bias on fc")])
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError("eagle_config.use_aux_hidden_state is false: only heads that fuse several target layers "
                         "are supported")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")}
    outputs = _layer_ids(eagle.get(AUX_LAYERS), f"eagle_config.{AUX_LAYERS}")
    if outputs is not None:
        inputs = [i + 1 for i in outputs]
        top = _layer_ids(raw.get(AUX_LAYERS), AUX_LAYERS)
        if top is not None and top != inputs:
            raise ValueError(f"eagle_config.{AUX_LAYERS} {outputs} (layer outputs) and {AUX_LAYERS} {top} (layer "
                             "inputs) name different layers")
        fields[AUX_LAYERS] = inputs
    return fields


def _speculators_fields(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """transformer_layer_config flattened, with the head's own top-level fields over it."""
    kind = _speculators_kind(raw)
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("lacks transformer_layer_config (the draft decoder layer's Llama config)")
    missing = [f"transformer_layer_config.{k}" for k in (*_REQUIRED, "model_type") if k not in layer]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}")
    if layer["model_type"] != "llama":
        raise ValueError(f"transformer_layer_config.model_type is {layer['model_type']!r}: only Llama decoder layers "
                         "(model_type llama) are supported")
    _refuse(layer, [("attention_bias", True, "biases on the attention projections"),
                    ("mlp_bias", True, "biases on the MLP projections")], "transformer_layer_config.")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise ValueError("transformer_layer_config.layer_types has sliding_attention: only full attention is supported")
    fields = dict(layer)
    if kind == "eagle1":
        _refuse(raw, [("layernorms", True, "extra norms around the decoder layer")])
        architecture = raw.get("transformer_layer_architecture", "auto")
        if architecture not in ("auto", "LlamaDecoderLayer"):
            raise ValueError(f"transformer_layer_architecture is {architecture!r}: only LlamaDecoderLayer is supported")
        # One decoder layer whatever the verifier's config copied into transformer_layer_config says.
        fields.update(num_hidden_layers=1, bias=bool(raw.get("fusion_bias", False)))
        return fields, kind
    if "norm_before_residual" not in raw:
        raise ValueError("lacks norm_before_residual (speculators defaults it to false, vLLM to true, so what the head "
                         "was trained with cannot be told)")
    _refuse(raw, [("norm_before_fc", True, "an RMSNorm over the fused features before fc"),
                  ("fc_norm", True, "an RMSNorm on each fused layer before fc"),
                  ("norm_output", True, "normed hidden states fed back between draft steps (EAGLE-3.1)")])
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", AUX_LAYERS):
        if raw.get(key) is not None:
            fields[key] = raw[key]
    return fields, kind


def _speculators_kind(raw: dict[str, Any]) -> str:
    if "speculators_model_type" not in raw:
        raise ValueError("lacks speculators_model_type (eagle or eagle3)")
    model_type = raw["speculators_model_type"]
    if model_type not in _SPECULATORS_KINDS:
        raise ValueError(f"speculators_model_type is {model_type!r}: only eagle and eagle3 heads are supported")
    return _SPECULATORS_KINDS[model_type]


def _refuse(raw: dict[str, Any], settings: list[tuple[str, Any, str]], where: str = "") -> None:
    """Name the first field set to a value whose computation the head modules lack."""
    for key, value, meaning in settings:
        if key in raw and raw[key] == value:
            raise ValueError(f"{where}{key} is {str(value).lower()}: {meaning}, which is not supported")


def _layer_ids(value: Any, name: str) -> list[int] | None:
    """The fused layers in ascending order, as the serving stacks concatenate them while the base runs."""
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
        raise ValueError(f"{name} is {value!r}: expected a list of layer numbers")
    if len(set(value)) != len(value):
        raise ValueError(f"{name} {value} names a layer twice")
    return sorted(value)


def _rope_type(rope: dict[str, Any]) -> str | None:
    return rope.get("rope_type", rope.get("type"))


def _check_head_shape(raw: dict[str, Any], kind: str) -> None:
    """Refuse shapes the head modules would build differently from the checkpoint's own code."""
    layers = raw.get("num_hidden_layers", 1)
    if kind == "eagle3" and layers != 1:
        raise ValueError(f"num_hidden_layers is {layers}: only one-layer EAGLE-3 heads are supported")
    head_dim, heads = raw.get("head_dim"), raw["num_attention_heads"]
    if kind == "eagle1" and head_dim and head_dim * heads != raw["hidden_size"]:
        raise ValueError(f"head_dim {head_dim} x num_attention_heads {heads} differs from hidden_size "
                         f"{raw['hidden_size']}: EAGLE-1 heads need them equal")
