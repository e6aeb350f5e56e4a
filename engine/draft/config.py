"""The draft head's config.json, in the official EAGLE layout (a Llama config with a few extra fields)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    draft_vocab_size: int | None = None  # EAGLE-3 only
    target_hidden_size: int | None = None  # EAGLE-3 only; defaults to hidden_size
    extra: dict[str, Any] = field(default_factory=dict)  # other fields, written back unchanged

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads: H_t for EAGLE-1, 3·H_t for EAGLE-3."""
        target = self.target_hidden_size or self.hidden_size
        return 3 * target if self.kind == "eagle3" else target

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], kind: str) -> "HeadConfig":
        required = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
        if kind == "eagle3":
            required.append("draft_vocab_size")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"head config.json lacks {', '.join(missing)}")
        scaling = raw.get("rope_scaling") or {}
        if scaling and scaling.get("type", scaling.get("rope_type")) not in ("linear", None):
            raise ValueError(f"unsupported rope_scaling {scaling} in head config (only linear is supported)")
        known = {
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling", "bias", "qkv_bias",
            "draft_vocab_size", "target_hidden_size",
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
            rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=float(scaling.get("factor", 1.0)),
            fc_bias=raw.get("bias", True),
            qkv_bias=raw.get("qkv_bias", False),
            draft_vocab_size=raw.get("draft_vocab_size") if kind == "eagle3" else None,
            target_hidden_size=raw.get("target_hidden_size"),
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
        return raw
