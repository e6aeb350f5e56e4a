"""`python -m engine.draft.export_gguf`: an EAGLE-3 head written as the GGUF file llama.cpp's `eagle3` architecture
loads as a draft model (llama-server --model-draft, xllamacpp's speculative.draft), with the `gguf` package alone.

The layout is the one llama.cpp's own converter writes for an EAGLE-3 checkpoint (convert_hf_to_gguf.py with
--target-model-dir) and its loader requires (src/models/eagle3.cpp):

  metadata  general.architecture = eagle3, eagle3.block_count = 1, eagle3.{context_length, embedding_length,
            feed_forward_length, vocab_size, attention.head_count, attention.head_count_kv,
            attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count}, eagle3.target_layers (the three
            fused target layers, int32), eagle3.target_hidden_size, eagle3.norm_before_residual,
            eagle3.norm_before_fc, and the target model's tokenizer.* fields: llama.cpp reads the draft's vocabulary
            from the draft file itself and refuses a draft whose vocabulary differs from the target's
  tensors   fc.weight, blk.0.{attn_norm, attn_norm_2 (hidden_norm), attn_q, attn_k, attn_v, attn_output, ffn_norm,
            ffn_gate, ffn_up, ffn_down}.weight, output_norm.weight, output.weight (over the draft vocabulary), d2t
            (int64 ABSOLUTE target ids: the checkpoint stores offsets, target = draft + d2t[draft]); token_embd.weight
            only for a head with its own embeddings (else llama.cpp borrows the target's); t2d is not written

Heads are read as the engine reads them (engine/draft/checkpoint.py: the official, SpecForge and speculators
layouts), so the fused layers are numbered as layer inputs, which is what llama.cpp captures. Two transformations,
both the converter's: attn_q and attn_k rows are permuted per head from the rotate-half RoPE layout of Hugging Face
Llama to the adjacent-pair layout llama.cpp's RoPE rotates, and d2t becomes absolute. Norms are float32, as
llama.cpp wants its 1-D tensors; matrices keep the head's dtype (float16 stays float16, float32 stays float32: the
converter's --outtype auto would turn float32 into float16, --outtype f16 here does the same).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..model.gguf_cache import sha256
from .checkpoint import WEIGHT_FILES, CheckpointError, head_folder, read_checkpoint
from .config import HeadConfig
from .eagle3 import fused_layers

ARCH = "eagle3"
FORMAT_VERSION = 1  # part of the cache key: bump when the written layout changes
# checkpoint key -> GGUF tensor name (llama.cpp's names for the eagle3 architecture)
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
    "d2t": "d2t",
}
NOT_WRITTEN = {"t2d"}  # the reverse vocabulary mask: llama.cpp does not read it
OUTTYPES = ("auto", "f32", "f16", "bf16")


class ExportError(CheckpointError):
    """A head, or a target model, that llama.cpp's EAGLE-3 draft cannot be made from."""


@dataclass(frozen=True)
class Target:
    """What the draft GGUF needs from the target model: its shape, and its tokenizer fields copied verbatim."""

    path: Path
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    tokenizer: dict  # key -> (value, GGUFValueType, array element type or None)


def read_target(gguf_path: str | Path) -> Target:
    """The target model's layer count, width, vocabulary size and tokenizer, from its GGUF file's metadata."""
    from gguf import GGUFReader, GGUFValueType

    path = Path(gguf_path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read target GGUF {path}: {err}") from err
    fields = reader.fields
    arch = _scalar(fields, "general.architecture", path)
    tokenizer = {key: _field_value(field, GGUFValueType) for key, field in fields.items()
                 if key.startswith("tokenizer.")}
    if "tokenizer.ggml.model" not in tokenizer or "tokenizer.ggml.tokens" not in tokenizer:
        raise ExportError(f"target GGUF {path} has no tokenizer; llama.cpp reads the draft's vocabulary from it")
    return Target(
        path=path,
        num_layers=int(_scalar(fields, f"{arch}.block_count", path)),
        hidden_size=int(_scalar(fields, f"{arch}.embedding_length", path)),
        vocab_size=len(tokenizer["tokenizer.ggml.tokens"][0]),
        context_length=int(_scalar(fields, f"{arch}.context_length", path)),
        tokenizer=tokenizer,
    )


def _scalar(fields: dict, key: str, path: Path):
    if key not in fields:
        raise ExportError(f"target GGUF {path} lacks {key}")
    return fields[key].contents()


def _field_value(field, value_types) -> tuple:
    """A metadata field as GGUFWriter.add_key_value takes it; strings stay raw bytes, so any token round-trips."""
    main = field.types[0]
    if main == value_types.ARRAY:
        sub = field.types[-1]
        if sub == value_types.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return field.contents(), main, sub
    if main == value_types.STRING:
        return bytes(field.parts[-1]), main, None
    return field.contents(), main, None


@dataclass(frozen=True)
class Eagle3Checkpoint:
    """An EAGLE-3 head as the engine reads it: its config and its tensors under the official names."""

    folder: Path
    config: HeadConfig
    state: dict[str, torch.Tensor]


def read_eagle3(source: str | Path) -> Eagle3Checkpoint:
    """Read a head folder (or hub id) in any layout the engine loads, refusing any head that is not EAGLE-3 with
    the file that says so."""
    folder, config, state, as_in_file = read_checkpoint(source)
    weights = next(folder / name for name in WEIGHT_FILES if (folder / name).exists())
    if config.kind != "eagle3":
        raise ExportError(f"{weights} is an EAGLE-1 head ({config.layout} layout): llama.cpp has no EAGLE-1 draft "
                          "loader, only EAGLE-3 (architecture eagle3); export an EAGLE-3 head")
    unknown = sorted(as_in_file(k) for k in set(state) - set(TENSOR_NAMES) - NOT_WRITTEN)
    if unknown:
        raise ExportError(f"{weights}: {', '.join(unknown)} have no place in llama.cpp's eagle3 layout")
    return Eagle3Checkpoint(folder, config, state)


def target_layers(config: HeadConfig, target: Target) -> list[int]:
    """The fused target layers as layer inputs: the head's own where it names them, else the official capture's."""
    return list(config.target_layers or fused_layers(target.num_layers))


def check_target(head: Eagle3Checkpoint, target: Target) -> None:
    """Refuse a target whose width or vocabulary differ from the head's, naming both files."""
    config = head.config
    width = config.target_hidden_size or config.hidden_size
    problems = []
    if width != target.hidden_size:
        problems.append(f"the head reads features {width} wide, the target's hidden size is {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"head vocab_size {config.vocab_size} vs the target's {target.vocab_size} tokens")
    layers = target_layers(config, target)
    if len(layers) != 3 or max(layers) >= target.num_layers:
        problems.append(f"fused layers {layers}: llama.cpp fuses the inputs of exactly 3 of the target's "
                        f"{target.num_layers} layers")
    if problems:
        raise ExportError(f"head {head.folder} does not fit target {target.path}: " + "; ".join(problems))


def rope_rows_for_llamacpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q_proj/k_proj rows reordered per head from rotate-half pairs (i, i + d/2) to adjacent pairs (2i, 2i + 1),
    the pairs llama.cpp's RoPE rotates for Llama-style models."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def absolute_d2t(d2t: torch.Tensor, vocab_size: int, where: Path) -> np.ndarray:
    """The checkpoint's offsets (target = draft + d2t[draft]) as the absolute target ids llama.cpp indexes with."""
    ids = d2t.to(torch.int64).reshape(-1) + torch.arange(d2t.numel(), dtype=torch.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ExportError(f"{where}: d2t maps draft tokens outside the target's {vocab_size} tokens")
    if ids.unique().numel() != ids.numel():
        raise ExportError(f"{where}: d2t maps two draft tokens to the same target token")
    return ids.numpy()


def gguf_tensors(head: Eagle3Checkpoint, target: Target) -> dict[str, torch.Tensor | np.ndarray]:
    """Every tensor under its GGUF name, transformed as llama.cpp reads it (float tensors still torch)."""
    heads, kv_heads = head.config.num_attention_heads, head.config.num_key_value_heads
    tensors: dict[str, torch.Tensor | np.ndarray] = {}
    for key, tensor in head.state.items():
        if key in NOT_WRITTEN:
            continue
        if key == "d2t":
            tensors["d2t"] = absolute_d2t(tensor, target.vocab_size, head.folder)
            continue
        if key.endswith("q_proj.weight"):
            tensor = rope_rows_for_llamacpp(tensor, heads)
        elif key.endswith("k_proj.weight"):
            tensor = rope_rows_for_llamacpp(tensor, kv_heads)
        tensors[TENSOR_NAMES[key]] = tensor
    return tensors


def _float_type(tensor: torch.Tensor, name: str, outtype: str):
    """llama.cpp's type for a float tensor: F32 for 1-D tensors and norms, else the head's dtype or `outtype`'s."""
    from gguf import GGMLQuantizationType as Q

    if tensor.dim() <= 1 or name.endswith("_norm.weight"):
        return Q.F32
    if outtype == "auto":
        return {torch.float16: Q.F16, torch.bfloat16: Q.BF16}.get(tensor.dtype, Q.F32)
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}[outtype]


def _encoded(tensor: torch.Tensor, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if qtype == Q.F32:
        return tensor.to(torch.float32).numpy()
    if qtype == Q.F16:
        return tensor.to(torch.float16).numpy()
    return quantize(tensor.to(torch.float32).numpy(), Q.BF16)


def _file_type(types: list) -> int:
    """general.file_type as llama.cpp's LlamaFileType: the type most of the weights take."""
    from gguf import GGMLQuantizationType as Q, LlamaFileType as F

    matrices = [t for t in types if t != Q.F32]
    return {Q.F16: F.MOSTLY_F16, Q.BF16: F.MOSTLY_BF16}.get(matrices[0], F.ALL_F32) if matrices else F.ALL_F32


def write_metadata(writer, head: Eagle3Checkpoint, target: Target) -> None:
    """The eagle3.* hyper-parameters llama.cpp's loader reads, and the target's tokenizer."""
    from gguf import GGUFValueType

    config = head.config
    writer.add_type("model")
    writer.add_name(head.folder.name)
    writer.add_block_count(1)
    writer.add_context_length(int(config.extra.get("max_position_embeddings") or target.context_length))
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.attention_head_dim)
    if config.head_dim:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.rope_scaling != 1.0:
        writer.add_string(f"{ARCH}.rope.scaling.type", "linear")
        writer.add_float32(f"{ARCH}.rope.scaling.factor", float(config.rope_scaling))
    writer.add_array(f"{ARCH}.target_layers", target_layers(config, target))
    writer.add_uint32(f"{ARCH}.target_hidden_size", int(config.target_hidden_size or target.hidden_size))
    writer.add_bool(f"{ARCH}.norm_before_residual", config.norm_before_residual)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)  # the head modules have no norm on the fused features
    for key, (value, value_type, sub_type) in target.tokenizer.items():
        writer.add_key_value(key, value, value_type, sub_type=sub_type if value_type == GGUFValueType.ARRAY else None)


def export_head(head_source: str | Path, out: str | Path, target: Target, outtype: str = "auto") -> Path:
    """Write the EAGLE-3 head at `head_source` to `out` as llama.cpp's eagle3 GGUF, for the target model `target`."""
    from gguf import GGMLQuantizationType as Q, GGUFWriter

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: choose among {', '.join(OUTTYPES)}")
    head = read_eagle3(head_source)
    if head.config.qkv_bias:
        raise ExportError(f"{head.folder}: llama.cpp's eagle3 has no q/k/v biases (qkv_bias is set)")
    check_target(head, target)
    tensors = gguf_tensors(head, target)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, arch=ARCH)
    types = []
    for name, tensor in tensors.items():
        if isinstance(tensor, np.ndarray):  # d2t
            writer.add_tensor(name, tensor, raw_dtype=Q.I64)
            continue
        qtype = _float_type(tensor, name, outtype)
        types.append(qtype)
        writer.add_tensor(name, _encoded(tensor, qtype), raw_dtype=qtype)
    write_metadata(writer, head, target)
    writer.add_file_type(_file_type(types))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def default_target_gguf(base: str | None) -> Path:
    """The target's GGUF file: --base's, or the embedded model's when --base is unset."""
    from ..model.load import gguf_file

    path = gguf_file(base)
    if path is None:
        raise ExportError(f"llama.cpp runs GGUF files: pass the target model's .gguf as --base (not {base}); convert "
                          "a Hugging Face model with llama.cpp's convert_hf_to_gguf.py first")
    return path


def cached_export(head_source: str | Path, target_gguf: Path, cache: Path) -> Path:
    """The head's GGUF for this target under `cache`, written once: keyed by the head's files, the target file and
    FORMAT_VERSION, written under a temporary name and renamed, so a cut-short export is never used."""
    folder = head_folder(head_source)
    digest = hashlib.sha256(f"eagle3-gguf-{FORMAT_VERSION}".encode())
    for file in [folder / "config.json", *(folder / n for n in WEIGHT_FILES), target_gguf]:
        if file.exists():
            digest.update(file.name.encode())
            digest.update(sha256(file).encode())
    out = cache / "eagle3-gguf" / f"{folder.name}-{digest.hexdigest()[:20]}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    os.close(handle)
    try:
        export_head(folder, staging, read_target(target_gguf))
        os.replace(staging, out)
    finally:
        Path(staging).unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m engine.draft.export_gguf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, help="EAGLE-3 head folder (config.json + model.safetensors) or hub id")
    parser.add_argument("--out", required=True, help="the GGUF file to write")
    parser.add_argument("--base", default=None,
                        help="the target model's GGUF file (its shape and tokenizer go into the draft); unset = the "
                             "embedded SmolLM2-135M-Instruct")
    parser.add_argument("--outtype", default="auto", choices=OUTTYPES,
                        help="type of the weight matrices; auto keeps the head's (norms are always f32)")
    args = parser.parse_args(argv)
    try:
        target = read_target(default_target_gguf(args.base))
        out = export_head(args.head, args.out, target, args.outtype)
    except (ValueError, OSError) as err:  # CheckpointError and ExportError are ValueErrors
        parser.error(str(err))
    print(f"wrote {out}: an EAGLE-3 draft for {target.path}")
    return out


if __name__ == "__main__":
    main()
