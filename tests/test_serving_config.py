"""A head this project trains carries the config fields and tensor names that SGLang's and vLLM's EAGLE-3 drafters
read (docs/models.md, "Serving it at scale"): a one-layer Llama config whose architecture SGLang maps to its EAGLE-3
draft model, the draft vocabulary with its d2t map, the fused layers, the base's context and rotary base, an LM head
of its own (not tied to an embedding it does not ship)."""
from __future__ import annotations

import json

from safetensors import safe_open

from engine.draft.checkpoint import new_head, save_head
from engine.draft.eagle3 import fused_layers
from engine.testing.tiny import tiny_base


def test_a_trained_heads_config_and_tensors_are_what_the_servers_read(tmp_path):
    base = tiny_base("qwen2-h32-l10-tied")
    base.config.max_position_embeddings = 32768
    base.config.rope_parameters["rope_theta"] = 1_000_000.0  # Qwen2.5's
    text = base.config
    folder = save_head(new_head("eagle3", base.config, 8), tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"  # SGLang: -> Eagle3
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 8 and config["vocab_size"] == 16
    assert not config.get("tie_word_embeddings", False)  # SGLang would point the LM head at the embedding
    assert not config.get("attention_bias", False) and not config.get("qkv_bias", False)
    assert config["eagle_aux_hidden_state_layer_ids"] == fused_layers(text.num_hidden_layers)  # as vLLM reads them
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        text.hidden_size, text.num_attention_heads, text.num_key_value_heads)
    assert (config["max_position_embeddings"], config["rope_theta"]) == (32768, 1_000_000.0)
    assert config["hidden_act"] == "silu" and "rms_norm_eps" in config
    with safe_open(str(folder / "model.safetensors"), "pt") as tensors:
        names = set(tensors.keys())
        assert tensors.get_tensor("fc.weight").shape == (text.hidden_size, 3 * text.hidden_size)
        assert tensors.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * text.hidden_size
        assert tensors.get_tensor("lm_head.weight").shape == (8, text.hidden_size)
    assert {"d2t", "t2d", "norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"} <= names
    assert not any(name.startswith("embed_tokens") for name in names)  # borrowed from the base at serving time
