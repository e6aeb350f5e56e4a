"""Write a random-weight model of a real model's shape as a GGUF file in llama.cpp's Q4_K_M mix, for measuring speed
on the models users bring without downloading one: `python -m scripts.random_gguf --shape llama-1b --out FILE`.

The weights are random (decoding speed does not depend on them); the layout, tensor types and tokenizer metadata
are a real file's, so the engine and llama.cpp both load it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine.testing.tiny_gguf import write_gguf

SHAPES = {
    # TinyLlama 1.1B's shape
    "llama-1b": (LlamaConfig, LlamaForCausalLM,
                 dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)),
    # Qwen2.5 0.5B's shape
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM,
                     dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
}


def q4_k_m_types(layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M choice: Q4_K, with attn_v and ffn_down in Q6_K in the first and last eighth of the layers
    and every third between, and the output in Q6_K."""
    types = {"default": "Q4_K", "output": "Q6_K"}
    for i in range(layers):
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            types[f"blk.{i}.attn_v.weight"] = types[f"blk.{i}.ffn_down.weight"] = "Q6_K"
    return types


@torch.no_grad()
def random_model(shape: str, seed: int = 0):
    config_cls, model_cls, sizes = SHAPES[shape]
    config = config_cls(max_position_embeddings=4096, **sizes)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to_empty(device="cpu").eval()
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.fill_(1.0)
        else:
            parameter.normal_(0, 0.02)
    model.tie_weights()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="llama-1b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = random_model(args.shape)
    write_gguf(model, args.out, q4_k_m_types(model.config.num_hidden_layers))
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
