"""Tiny models (engine/testing/tiny.py) as real GGUF files (`write_gguf`, `tiny_gguf`), laid out as llama.cpp's
converter writes one and with a tiny tokenizer of the kind it writes, so what a user's own GGUF goes through
(loading, training a head, decoding) runs on every architecture in seconds; `quantize_blocks` encodes weights in the
GGUF types, K-quants included; `damaged_gguf` damages a file at the format's edges, as a bad download or a lying header does. Apart from tiny.py, which the GPU check imports where the gguf package is absent."""
from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES, MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, GGUFWriter, get_tensor_name_map,
)
from gguf.quants import quantize
from transformers import AutoConfig, PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .tiny import tiny_base

# One shape per architecture whose GGUF transformers reads back as the same model. transformers takes what the file
# does not state from its config defaults: Qwen3's head_dim (128), Gemma 3's query_pre_attn_scalar (256), its
# local RoPE base and its pattern of one global layer in six, so these shapes keep those defaults.
GGUF_VOCAB = 320  # room for every byte, a tokenizer's special tokens and a few dozen merges
GGUF_SHAPES = {
    "llama": "llama-h64-l8-gqa",
    "qwen2": "qwen2-h32-l10-tied",
    "qwen3": "qwen3-h32-l7-d128",
    "gemma3": "gemma3-h64-l8-swa",
}

# --- GGUF blocks -----------------------------------------------------------------------------------------------

QK_K = 256  # weights in a K-quant block
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
GGUF_PY_KINDS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf-py quantizes these itself
# What llama.cpp writes instead where a row does not split into the type's blocks (its K-quant fallbacks, then F16).
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def quantize_k(weights: np.ndarray, kind: str) -> np.ndarray:
    """`weights` [..., n] (n a multiple of 256) as ggml's block_q4_K / block_q5_K / block_q6_K bytes [..., bytes a
    row], laid out as a GGUF file stores them. Each sub-block is rounded over its own range (min-max for Q4_K and
    Q5_K, with the min kept at or below zero as ggml's unsigned min codes require; symmetric for Q6_K) and the
    sub-block scales and mins are coded against the block's largest, which takes the top code: simpler than
    llama.cpp's search, the same layout."""
    encoders = {"Q4_K": _encode_q4_k, "Q5_K": _encode_q5_k, "Q6_K": _encode_q6_k}
    if kind not in encoders:
        raise ValueError(f"unknown K-quant {kind!r}; choose one of {', '.join(K_QUANTS)}")
    weights = np.asarray(weights, dtype=np.float32)
    if weights.shape[-1] % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} weights, not {weights.shape[-1]}")
    blocks = encoders[kind](weights.reshape(-1, QK_K))
    return blocks.reshape(*weights.shape[:-1], -1)


def quantize_blocks(weights: np.ndarray, kind: str) -> np.ndarray:
    """`weights` [..., n] in GGUF type `kind` (a K-quant or one of GGUF_PY_KINDS) as the bytes the file stores,
    uint8 [..., bytes a row]: one entry point for every type a tiny GGUF is written in."""
    if kind in K_QUANTS:
        return quantize_k(weights, kind)
    if kind not in GGUF_PY_KINDS:
        raise ValueError(f"unknown GGUF type {kind!r}; choose one of {', '.join(GGUF_PY_KINDS + K_QUANTS)}")
    encoded = quantize(np.asarray(weights, dtype=np.float32), GGMLQuantizationType[kind])
    return np.ascontiguousarray(encoded).view(np.uint8)


def _coded(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative values [B, G] as codes 0..top times one float16 factor a block. Codes round up, so a coded step
    or min always covers the one wanted (no weight is clipped), and the largest value takes `top`."""
    largest = values.max(-1, keepdims=True)
    factor = (largest / top).astype(np.float16)
    factor = np.where(factor.astype(np.float32) * top < largest, np.nextafter(factor, np.float16(np.inf)), factor)
    step = factor.astype(np.float32)
    codes = np.ceil(values / np.where(step > 0, step, 1)) * (step > 0)
    return codes.clip(0, top).astype(np.uint8), factor


def _codes(sub: np.ndarray, step: np.ndarray, offset: np.ndarray, low: int, high: int) -> np.ndarray:
    """Each weight's code in low..high: (w + offset) / step, rounded; 0 where a sub-block's step is zero."""
    step, offset = step[..., None], offset[..., None]
    codes = np.rint((sub + offset) / np.where(step > 0, step, 1)) * (step > 0)
    return codes.clip(low, high)


def _k_scales(blocks: np.ndarray, top: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q4_K/Q5_K: codes 0..top [B, 8, 32], and the block's head: fp16 d, fp16 dmin, the 12 bytes of 6-bit scale and
    min codes. A sub-block's min is kept at or below zero, as ggml's unsigned min codes need; its step spans from
    the coded min to its largest weight."""
    sub = blocks.reshape(len(blocks), 8, 32)
    mins, dmin = _coded(-np.minimum(sub.min(-1), 0), 63)
    offset = dmin.astype(np.float32) * mins
    scales, d = _coded((sub.max(-1) + offset) / top, 63)
    q = _codes(sub, d.astype(np.float32) * scales, offset, 0, top).astype(np.uint8)
    return q, [d.view(np.uint8), dmin.view(np.uint8), _pack_six_bit(scales, mins)]


def _pack_six_bit(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes for eight 6-bit scales and mins: bytes 0-3 scales 0-3, bytes 4-7 mins 0-3, each with the top
    two bits of scale / min 4-7 in its own top two bits; bytes 8-11 the low nibbles of scale (low) and min (high)
    4-7."""
    first = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    second = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    third = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [B, 8, 32] as 128 bytes: sub-blocks 2i (low nibble) and 2i+1 (high nibble) share bytes 32i..32i+31."""
    low = q & 0x0F
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(q), -1)


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    q, head = _k_scales(blocks, 15)
    return np.concatenate(head + [_nibbles(q)], axis=1)


def _encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """As Q4_K with a fifth bit: bit j of byte l of qh is the high bit of weight l of sub-block j."""
    q, head = _k_scales(blocks, 31)
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = (((q >> 4) & 1) << shifts).sum(1, dtype=np.uint8)
    return np.concatenate(head + [qh, _nibbles(q)], axis=1)


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Sixteen sub-blocks of 16 with signed int8 scales and codes -32..31, stored +32: the low nibbles in ql (each
    half of the block: weights 0-63 low, 64-127 high), the top two bits in qh (four 32-weight runs a byte), then
    the scales and fp16 d."""
    sub = blocks.reshape(len(blocks), 16, 16)
    scales, d = _coded(np.abs(sub).max(-1) / 31, 127)  # int8 scales, used as 0..127
    step = d.astype(np.float32) * scales
    q = (_codes(sub, step, np.zeros_like(step), -32, 31) + 32).astype(np.uint8).reshape(len(blocks), 2, 128)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    qh = (((q.reshape(len(blocks), 2, 4, 32) >> 4) & 3) << shifts).sum(2, dtype=np.uint8)
    parts = [ql.reshape(len(blocks), -1), qh.reshape(len(blocks), -1), scales.view(np.uint8), d.view(np.uint8)]
    return np.concatenate(parts, axis=1)


# --- GGUF files ------------------------------------------------------------------------------------------------

# transformers' model_type -> the architecture llama.cpp writes
ARCHITECTURES = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3,
                 "gemma3_text": MODEL_ARCH.GEMMA3}
# The tokenizer model llama.cpp writes for an architecture: SentencePiece ("llama") for Gemma, byte-level BPE
# ("gpt2") for Llama 3 and Qwen.
TOKENIZER_MODELS = {MODEL_ARCH.GEMMA3: "llama"}
# The first ids of a tiny vocabulary: Gemma's five and Qwen's end of text, which transformers' Gemma and Qwen2
# tokenizers add past the vocabulary where a file lacks them, then ChatML's turn markers.
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Bytes a vocabulary too small for all 256 keeps, most useful first; then the rest in byte order.
_FREQUENT = b" etaoinsrhldcumfpgwybvkxjqz\nETAOINSRHLDCUMFPGWYBVKXJQZ0123456789.,!?'\"-:;()"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6  # llama.cpp's token types
# What transformers reads back to build the model: a file that states one differently loads as another model.
_READ_BACK = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "max_position_embeddings", "sliding_window", "layer_types",
              "query_pre_attn_scalar")


def tiny_vocabulary(size: int, model: str = "gpt2") -> tuple[list[str], list[int], list[str]]:
    """A vocabulary of exactly `size` tokens for GGUF's tokenizer `model`, spelled as llama.cpp spells it: SPECIALS,
    then single bytes, then merges of a letter onto a word start or onto a merged token. "gpt2" (byte-level BPE):
    all 256 bytes where they fit, else the most frequent; "llama" (SentencePiece with byte fallback): the 256 byte
    tokens <0x00>..<0xFF> where they fit beside the letters, then "▁" and the frequent characters. Returns (tokens,
    llama.cpp token types, merges; SentencePiece files list none)."""
    room = size - len(SPECIALS)
    if room < 1:
        raise ValueError(f"a tiny vocabulary needs more than {len(SPECIALS)} tokens, not {size}")
    pieces, types, merges = _sentencepiece_pieces(room) if model == "llama" else _byte_level_pieces(room)
    special_types = [_UNKNOWN if token == "<unk>" else _CONTROL for token in SPECIALS]
    return list(SPECIALS) + pieces, special_types + types, merges


def _byte_level_pieces(room: int) -> tuple[list[str], list[int], list[str]]:
    spelling = bytes_to_unicode()
    singles = [spelling[byte] for byte in list(dict.fromkeys([*_FREQUENT, *range(256)]))[:room]]
    merges = _merge_pairs(room - len(singles), "Ġ")
    pieces = singles + [left + right for left, right in merges]
    return pieces, [_NORMAL] * room, [f"{left} {right}" for left, right in merges]


def _sentencepiece_pieces(room: int) -> tuple[list[str], list[int], list[str]]:
    characters = ["▁"] + [chr(c) for c in _FREQUENT if chr(c).isprintable() and not chr(c).isspace()]
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)] if room > 256 + len(_LETTERS) else []
    singles = characters[: room - len(byte_tokens)]
    merges = _merge_pairs(room - len(byte_tokens) - len(singles), "▁")
    pieces = byte_tokens + singles + [left + right for left, right in merges]
    return pieces, [_BYTE] * len(byte_tokens) + [_NORMAL] * (room - len(byte_tokens)), []


def _merge_pairs(count: int, word_start: str) -> list[tuple[str, str]]:
    """`count` merges, each a letter appended to a word start, a letter or an earlier merge: every merged token is
    new, and each merge's parts are tokens already."""
    pairs, lefts = [], [word_start, *_LETTERS]
    while len(pairs) < count:
        longer = []
        for left in lefts:
            for letter in _LETTERS[: count - len(pairs)]:
                pairs.append((left, letter))
                longer.append(left + letter)
            if len(pairs) == count:
                break
        lefts = longer
    return pairs


def write_gguf(model: PreTrainedModel, path: str | Path, types: dict[str, str] | str = "F32",
               chat_template: bool = True) -> Path:
    """Write a tiny Llama, Qwen2, Qwen3 or Gemma 3 model as llama.cpp's converter would, with a tiny tokenizer of the
    kind it writes (tiny_vocabulary): transformers' GGUF loader reads it back as the same model, with the same
    float32 weights (a quantized tensor's as its blocks dequantize); a file it would read as another model is
    refused (ValueError).

    types: the GGUF type of the 2-D tensors, one for all (e.g. "Q8_0") or by tensor, its GGUF name or role first
    ({"blk.0.attn_q.weight": "Q4_K", "ffn_down": "Q6_K", "default": "Q8_0"}); norms and biases stay F32. A row
    that does not split into the type's blocks takes llama.cpp's fallback (FALLBACK, then F16), as a real model's
    odd-sized tensors do. chat_template: write a ChatML template (False: a base model that continues plain text).
    A Gemma 3 norm weight w is stored as w + 1, as llama.cpp stores it, which gives w back exactly where w + 1 is
    exact in float32 (as for tiny_base's multiples of 1/64)."""
    config, path = model.config, Path(path)
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"no GGUF layout for {config.model_type!r}; choose one of {', '.join(ARCHITECTURES)}")
    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[arch])
    _add_model_metadata(writer, config)
    _add_tokenizer(writer, config.vocab_size, TOKENIZER_MODELS.get(arch, "gpt2"), chat_template)
    for name, array in _gguf_tensors(model, arch):
        kind = _fitting_type(_chosen_type(name, array, types), array.shape[-1])
        writer.add_tensor(name, quantize_blocks(array, kind), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _check_read_back(config, path)
    return path


def tiny_gguf(architecture: str, folder: str | Path, types: dict[str, str] | str = "F32", chat_template: bool = True,
              vocab: int = GGUF_VOCAB, seed: int = 0) -> Path:
    """The tiny model of GGUF_SHAPES[architecture] written by write_gguf into `folder`, named after its shape and
    options."""
    shape = GGUF_SHAPES[architecture]
    name = f"{shape}-{types if isinstance(types, str) else 'mixed'}{'' if chat_template else '-plain'}.gguf"
    return write_gguf(tiny_base(shape, vocab, seed), Path(folder) / name, types, chat_template)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_theta(config) -> float:
    """The RoPE base of the global layers (Gemma 3 keeps one per layer type; its local one is not written)."""
    rope = config.rope_parameters
    return rope.get("full_attention", rope)["rope_theta"]


def _add_model_metadata(writer: GGUFWriter, config) -> None:
    """The hyperparameters llama.cpp's converter writes, under the architecture's keys."""
    writer.add_name(f"tiny {config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)


def _add_tokenizer(writer: GGUFWriter, size: int, model: str, chat_template: bool) -> None:
    """tiny_vocabulary as GGUF's tokenizer `model`; the end token is <|im_end|> with the chat template, else <eos>
    (no token is added to a text)."""
    tokens, token_types, merges = tiny_vocabulary(size, model)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if model == "llama":
        writer.add_token_scores([-float(i) for i in range(len(tokens))])  # earlier pieces merge first
    else:
        writer.add_token_merges(merges)
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_bos_token_id(tokens.index("<bos>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>" if chat_template else "<eos>"))
    writer.add_pad_token_id(tokens.index("<pad>"))
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(CHATML)


def _gguf_tensors(model: PreTrainedModel, arch: MODEL_ARCH) -> list[tuple[str, np.ndarray]]:
    """The model's tensors under their GGUF names, as llama.cpp's converter changes them: Llama's q and k rows
    permuted, Gemma's norm weights stored plus one; a tied LM head is left out (the file then has no output)."""
    config = model.config
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{hf_name} has no GGUF name in the {MODEL_ARCH_NAMES[arch]} layout")
        array = tensor.detach().float().cpu().numpy()
        if arch == MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            array = _rope_permuted(array, heads)
        if arch == MODEL_ARCH.GEMMA3 and hf_name.endswith("norm.weight"):
            array = array + np.float32(1)
        tensors.append((name, array))
    return tensors


def _rope_permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a Llama q/k projection: each head's two rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _chosen_type(name: str, array: np.ndarray, types: dict[str, str] | str) -> str:
    """The type asked for a tensor: by its GGUF name, then its role (the name without blk.N. and .weight), then
    "default"; F32 for a 1-D tensor."""
    if array.ndim < 2:
        return "F32"
    if isinstance(types, str):
        return types
    role = name.removesuffix(".weight").split(".")[-1]
    return types.get(name, types.get(role, types.get("default", "F32")))


def _fitting_type(kind: str, columns: int) -> str:
    """`kind`, or llama.cpp's fallback for it where a row of `columns` weights does not split into its blocks."""
    while columns % GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]:
        kind = FALLBACK.get(kind, "F16")
    return kind


def _as_stored(value):
    """A float as GGUF stores it (float32), so that an epsilon read back compares equal to the one written."""
    return np.float32(value) if isinstance(value, float) else value


def _check_read_back(config, path: Path) -> None:
    """Refuse a file that transformers would read as another model (a shape its GGUF loader takes from config
    defaults rather than the file)."""
    loaded = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    wrong = [f"{field}: {getattr(loaded, field, None)!r} instead of {getattr(config, field, None)!r}"
             for field in _READ_BACK
             if _as_stored(getattr(loaded, field, None)) != _as_stored(getattr(config, field, None))]
    if wrong:
        raise ValueError(f"transformers reads {path} as another model (" + "; ".join(wrong) + ")")


# --- damaged files ---------------------------------------------------------------------------------------------

TRUNCATED = "is truncated: its tensors need"
DAMAGED_HEADER = "is not a readable GGUF file: its header is damaged"


@dataclass(frozen=True)
class GgufLayout:
    """A whole GGUF file's bytes and where its parts lie: what the damages cut and rewrite."""

    data: bytes
    tensors: int  # the header's tensor count
    fields: int  # the header's metadata count
    table: int  # where the tensor table starts (and the metadata ends)
    table_end: int

    @classmethod
    def of(cls, path: str | Path) -> GgufLayout:
        """The layout of a file that ends where its last tensor does (as tiny_gguf's do), so every cut takes
        weights."""
        data, reader = Path(path).read_bytes(), GGUFReader(path)
        last = reader.tensors[-1]
        if last.data_offset + last.n_bytes != len(data):
            raise ValueError(f"{path} does not end where its last tensor does")
        table_end = last.field.offset + sum(part.nbytes for part in last.field.parts)
        return cls(data, *struct.unpack_from("<QQ", data, 8), reader.tensors[0].field.offset, table_end)


def _with_alignment_zero(f: GgufLayout) -> bytes:
    """One more metadata entry, general.alignment = 0 (uint32), before the others."""
    entry = struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, 0)
    return f.data[:16] + struct.pack("<Q", f.fields + 1) + entry + f.data[24:]


# A GGUF damaged at each edge of the format (cut short at its end, in its metadata and in its tensor table; a
# tensor placed past the end, counts that lie, an alignment of zero, a wrong magic, an unsupported version): the
# damaged bytes, and what the error refusing them must say after the file's name.
GGUF_DAMAGES: dict[str, Callable[[GgufLayout], tuple[bytes, str]]] = {
    **{f"{n}-short": (lambda f, n=n: (f.data[:-n], TRUNCATED)) for n in (1, 7, 31)},
    "cut-in-metadata": lambda f: (
        f.data[: 24 + 5], f"{DAMAGED_HEADER} ({f.fields} metadata entries cannot fit in the 5 bytes left"),
    "cut-at-metadata-end": lambda f: (
        f.data[: f.table - 3], f"{DAMAGED_HEADER} (metadata entry {f.fields} of {f.fields} runs past the end"),
    "cut-in-tensor-table": lambda f: (
        f.data[: f.table + 5], f"{DAMAGED_HEADER} ({f.tensors} tensor entries cannot fit in the 5 bytes left"),
    "cut-at-tensor-table-end": lambda f: (
        f.data[: f.table_end - 3], f"{DAMAGED_HEADER} (tensor entry {f.tensors} of {f.tensors} runs past the end"),
    "offset-past-end": lambda f: (  # the last entry's last 8 bytes: its offset into the data
        f.data[: f.table_end - 8] + struct.pack("<Q", len(f.data)) + f.data[f.table_end :], TRUNCATED),
    "tensor-count-lies": lambda f: (
        f.data[:8] + struct.pack("<Q", f.tensors + 5) + f.data[16:],
        f"{DAMAGED_HEADER} (tensor entry {f.tensors + 1} of {f.tensors + 5} runs past the end"),
    "tensor-count-huge": lambda f: (
        f.data[:8] + struct.pack("<Q", 2**62) + f.data[16:], f"{DAMAGED_HEADER} ({2**62:,} tensor entries cannot fit"),
    "alignment-zero": lambda f: (
        _with_alignment_zero(f), f"{DAMAGED_HEADER} (general.alignment is 0, not a power of two)"),
    "wrong-magic": lambda f: (
        b"GGML" + f.data[4:], "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    "version-1": lambda f: (f.data[:4] + struct.pack("<I", 1) + f.data[8:], "GGUF version 1 is not supported (2 or 3)"),
}


def damaged_gguf(path: str | Path, folder: str | Path, damage: str) -> tuple[Path, str]:
    """A copy of the GGUF at `path` with GGUF_DAMAGES[damage] done to it, written into `folder`, and what the error
    refusing it must say after the file's name."""
    content, message = GGUF_DAMAGES[damage](GgufLayout.of(path))
    copy = Path(folder) / f"{damage}.gguf"
    copy.write_bytes(content)
    return copy, message
