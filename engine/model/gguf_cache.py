"""A local GGUF converted once into a Hugging Face folder, so later loads skip transformers' GGUF parsing.

transformers reads a GGUF through gguf-py, which parses every metadata field in Python, three times per load (the
config, the tokenizer, the weights): for SmolLM2's 49k-token vocabulary that is most of the app's start-up and of
every real-model test. The first load writes what it produced (the float32 weights exactly as dequantized, the
config, the tokenizer) under the user's cache; later loads read safetensors. The folder is keyed by the file's
SHA-256 (quick for a small model's file; the same file copied elsewhere shares one copy) and transformers' version
(its dequantizing code), written under a temporary name and renamed, so two processes converting at once or a
conversion cut short leave no half folder behind. Copies unused for UNUSED_DAYS are removed at the next conversion.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils.quantization_config import GgufConfig

log = logging.getLogger(__name__)
# A float32 copy is 4-8× the GGUF: worth it for the small models a CPU chat runs, not for a 70B file.
MAX_CONVERTED_BYTES = 4 * 2**30
COMPLETE = "source.json"  # written last: a folder without it is not used; touched at each use
UNUSED_DAYS = 30


def cache_root() -> Path:
    """$EAGLE_CHAT_CACHE, else eagle-chat under $XDG_CACHE_HOME (~/.cache)."""
    if os.environ.get("EAGLE_CHAT_CACHE"):
        return Path(os.environ["EAGLE_CHAT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "eagle-chat"


def sha256(path: Path) -> str:
    """A file's SHA-256, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(16 * 2**20):
            digest.update(block)
    return digest.hexdigest()


def _source_facts(gguf: Path) -> dict:
    return {"sha256": sha256(gguf), "bytes": gguf.stat().st_size, "transformers": transformers.__version__}


def _folder(facts: dict, weights: bool = True) -> Path:
    return cache_root() / "gguf" / (f"{facts['sha256'][:24]}-transformers-{facts['transformers']}"
                                    f"{'' if weights else '-described'}")


def converted_folder(gguf: Path) -> Path:
    """Where the converted copy of `gguf` lives (whether or not it exists yet)."""
    return _folder(_source_facts(gguf))


def dequantizing(gguf_file: str) -> GgufConfig:
    """transformers' GGUF loading to float weights. Said up front, or transformers warns that its quantized GGUF
    kernels prefer float32 before it finds it has none here and dequantizes anyway."""
    return GgufConfig(gguf_file=gguf_file, dequantize=True)


def _is_complete(folder: Path, facts: dict) -> bool:
    try:
        return json.loads((folder / COMPLETE).read_text()) == facts
    except (OSError, ValueError):
        return False


def _remove_unused(root: Path) -> None:
    """Copies whose last use is UNUSED_DAYS old: their GGUF was most likely deleted, moved or changed."""
    cutoff = time.time() - UNUSED_DAYS * 86400
    for marker in root.glob(f"*/{COMPLETE}"):
        if marker.stat().st_mtime < cutoff:
            log.info("removing %s, unused for %d days", marker.parent, UNUSED_DAYS)
            shutil.rmtree(marker.parent, ignore_errors=True)


def _convert(gguf: Path, facts: dict, weights: bool) -> None:
    """Write the folder: config, generation config and tokenizer, and with `weights` the float32 weights."""
    folder = _folder(facts, weights)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_unused(folder.parent)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        source = {"gguf_file": gguf.name, "local_files_only": True}
        if weights:
            log.info("converting %s once into %s (later loads skip parsing the GGUF)", gguf, folder)
            AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32,
                                                 quantization_config=dequantizing(gguf.name), **source
                                                 ).save_pretrained(staging)
        else:
            log.info("reading %s's configuration and tokenizer once into %s", gguf, folder)
            config = AutoConfig.from_pretrained(str(gguf.parent), **source)
            config.save_pretrained(staging)
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        AutoTokenizer.from_pretrained(str(gguf.parent), **source).save_pretrained(staging)
        (staging / COMPLETE).write_text(json.dumps(facts, sort_keys=True))
        if _is_complete(folder, facts):  # another process finished first (and may be loading from it)
            return
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier copy
        try:
            staging.rename(folder)
        except OSError:  # another process renamed its copy first: keep that one
            if not _is_complete(folder, facts):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def converted(gguf: Path, weights: bool = True) -> Path | None:
    """The converted folder of a local GGUF, converting it on first use; None where no copy is kept (a file too
    large to copy in float32, or a cache that cannot be written), and the caller loads the GGUF itself. weights=False:
    a folder with the configuration and tokenizer only (what a model built straight from the GGUF's groups needs),
    or the full copy where one exists."""
    if weights and gguf.stat().st_size * 8 > MAX_CONVERTED_BYTES:  # at ≥ 4 bits a weight, float32 takes ≥ 8×
        return None
    facts = _source_facts(gguf)
    folder = _folder(facts, weights)
    if not weights and _is_complete(_folder(facts), facts):
        folder = _folder(facts)
    elif not _is_complete(folder, facts):
        try:
            _convert(gguf, facts, weights)
        except OSError as err:
            log.warning("could not keep a converted copy of %s under %s (%s): parsing the GGUF on every load",
                        gguf, cache_root(), err)
            return None
    try:
        (folder / COMPLETE).touch()  # its last use, for _remove_unused
    except OSError:  # a cache shared read-only
        pass
    return folder


def forget(folder: Path) -> None:
    """Drop a converted copy that failed to load; the next load converts again."""
    log.warning("the converted copy %s does not load: removing it and converting again", folder)
    shutil.rmtree(folder, ignore_errors=True)
