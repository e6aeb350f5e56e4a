"""Tiny random-weight base models of several shapes and families, with random draft heads: what the test suite and
the GPU check (engine/tools/gpu_check.py) decode with when exactness, not quality, is being checked. No weights to
download: every model is built from a seed, its norms and biases drawn too (draw_norms_and_biases), so that every
parameter a real file has takes part. engine/testing/tiny_gguf.py writes them as GGUF files."""
from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
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
    model = model_cls(config).eval().requires_grad_(False)
    draw_norms_and_biases(model, seed, offset_norms=config.model_type in OFFSET_NORMS)
    model = model.to(dtype)
    model.generation_config.eos_token_id = None
    return model


# Families whose norms store an offset: the weight w scales by 1 + w, and starts at zero.
OFFSET_NORMS = ("gemma3_text",)
# A norm's drawn scales, in 64ths: 0.5 to 2 (an offset norm's weights -0.5 to 8, scales 0.5 to 9: with scales of one,
# a random Gemma with tied embeddings repeats one token for ever). Biases: 1/64 to 1/2 either side of zero.
NORM_SCALES, OFFSET_NORM_WEIGHTS, BIAS_SIZES = (32, 129), (-32, 512), (1, 33)


@torch.no_grad()
def draw_norms_and_biases(module: torch.nn.Module, seed: int, offset_norms: bool = False) -> None:
    """Give every norm weight and bias of `module` drawn values, from a generator seeded with `seed`. Random
    initialisation leaves them at one (an offset norm's at zero) and zero, where a real model's are not: a path
    that ignored a bias, a norm or a norm's offset would then give the same numbers as one that reads them. Every
    value a multiple of 1/64, which a GGUF's float32 (and Gemma's stored w + 1) keeps exactly; no bias is zero."""
    generator = torch.Generator().manual_seed(seed)
    for name, weight in module.named_parameters():
        if name.endswith("norm.weight"):
            low, high = OFFSET_NORM_WEIGHTS if offset_norms else NORM_SCALES
            weight.copy_(torch.randint(low, high, weight.shape, generator=generator) / 64)
        elif name.endswith(".bias"):
            sign = torch.randint(0, 2, weight.shape, generator=generator) * 2 - 1
            weight.copy_(sign * torch.randint(*BIAS_SIZES, weight.shape, generator=generator) / 64)


def random_head(model, kind: str, seed: int = 1):
    """A random draft head of `kind` ("eagle1" or "eagle3") placed beside `model`."""
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    head = new_head(kind, model.config, draft_vocab_size=vocab - 4 if kind == "eagle3" else None)
    if kind == "eagle3":
        head.set_vocab(torch.randperm(vocab)[: vocab - 4])
    for p in head.parameters():  # larger weights than the default init: sharper, more varied drafts
        torch.nn.init.normal_(p, std=0.3)
    draw_norms_and_biases(head, seed)  # norms that scale as a trained head's do, not around zero
    return place_head(head, model)


def tokens_of(steps) -> list[int]:
    """The tokens of a generation's steps, in order."""
    return [t for s in steps for t in s.tokens]
