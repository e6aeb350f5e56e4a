"""Tiny random-weight base models of several shapes and families, with random draft heads: what the test suite and
the GPU check (engine/tools/gpu_check.py) decode with when exactness, not quality, is being checked. No weights to
download: every model is built from a seed. engine/testing/tiny_gguf.py writes them as GGUF files."""
from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config,
    Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from ..draft.checkpoint import new_head, place_head

# A small vocabulary makes random drafts hit often, so multi-token paths are exercised.
VOCAB = 16
SHAPES = {
    "llama-h64-l8-gqa": (LlamaConfig, LlamaForCausalLM,
                         dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)),
    "llama-h48-l7-mqa": (LlamaConfig, LlamaForCausalLM,
                         dict(hidden_size=48, num_hidden_layers=7, num_attention_heads=3, num_key_value_heads=1)),
    "qwen2-h32-l10-tied": (Qwen2Config, Qwen2ForCausalLM,
                           dict(hidden_size=32, num_hidden_layers=10, num_attention_heads=2, num_key_value_heads=2,
                                tie_word_embeddings=True)),
    "qwen3-h64-l9": (Qwen3Config, Qwen3ForCausalLM,
                     dict(hidden_size=64, num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16)),
}
MORE_SHAPES = {
    "qwen3-h32-l7-d128": (Qwen3Config, Qwen3ForCausalLM,
                          dict(hidden_size=32, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=128)),
    # layers 0-4 and 6-7 slide over 32 tokens, layer 5 is global; q/k norms; tied embeddings (Gemma 3's default)
    "gemma3-h64-l8-swa": (Gemma3TextConfig, Gemma3ForCausalLM,
                          dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, sliding_window=32)),
    # Rows of 256 and 512 weights, so that every projection takes K-quant blocks (256 weights each).
    "llama-h256-l3": (LlamaConfig, LlamaForCausalLM,
                      dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512)),
    "qwen2-h256-l3": (Qwen2Config, Qwen2ForCausalLM,
                      dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, tie_word_embeddings=True)),
    "gemma3-h256-l6-swa": (Gemma3TextConfig, Gemma3ForCausalLM,
                           dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=64, sliding_window=32, intermediate_size=512)),
}
# A dynamic tree that branches and reaches three levels: lossless checks need tree rows that see different
# ancestors (the default tree drafts a single token).
BRANCHING = dict(total_tokens=8, depth=2, draft_top_k=4)


class IdsOnlyTokenizer:
    """The tiny models are fed token ids directly; only the stop-token lookup needs a tokenizer."""

    eos_token_id = None


def tiny_base(shape: str, vocab: int = VOCAB, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random-weight base model of one of SHAPES or MORE_SHAPES, in eval mode, without a stop token."""
    config_cls, model_cls, sizes = (SHAPES | MORE_SHAPES)[shape]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab, initializer_range=0.25, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, **({"intermediate_size": 96} | sizes),
    )
    model = model_cls(config).to(dtype).eval().requires_grad_(False)
    if config.model_type == "gemma3_text":
        _draw_norms(model)
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def _draw_norms(model: PreTrainedModel) -> None:
    """Random Gemma norm weights, in multiples of 1/64 from -0.5 to 8 (scales 0.5 to 9). Gemma's start at zero, a
    scale of one on every sub-layer's output, and a random model with tied embeddings then repeats one token for
    ever; multiples of 1/64 survive the file's w + 1 exactly."""
    for name, weight in model.named_parameters():
        if name.endswith("norm.weight"):
            weight.copy_(torch.randint(-32, 512, weight.shape) / 64)


def random_head(model, kind: str, seed: int = 1):
    """A random draft head of `kind` ("eagle1" or "eagle3") placed beside `model`."""
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    head = new_head(kind, model.config, draft_vocab_size=vocab - 4 if kind == "eagle3" else None)
    if kind == "eagle3":
        head.set_vocab(torch.randperm(vocab)[: vocab - 4])
    for p in head.parameters():  # larger weights than the default init: sharper, more varied drafts
        torch.nn.init.normal_(p, std=0.3)
    return place_head(head, model)


def tokens_of(steps) -> list[int]:
    """The tokens of a generation's steps, in order."""
    return [t for s in steps for t in s.tokens]
