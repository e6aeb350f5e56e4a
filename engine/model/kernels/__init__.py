"""The engine's own CPU kernels (the C++ beside this file, one job a file: kernels.h lists them): 4- and 8-bit
grouped linear layers (on float32 or int8 activations) and a float32 attention whose rows come out the same bits
whatever shares their forward, and whole forwards built from them (engine.model.fused).

Compiled on first use with torch's extension builder (a C++ compiler and ninja; cached under
~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR) for x86 CPUs with AVX2 and FMA. Where that cannot happen the
engine keeps its float kernels (engine.model.packed, engine.model.attention's float64 path) and says why once.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(str(source) for source in HERE.glob("*.cpp"))  # each includes kernels.h, from HERE
# No contraction the source does not ask for; OpenMP, without which every kernel runs on one thread.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def unavailable_reason() -> str | None:
    """None when torch.ops.eagle_cpu is loaded (building it on first call), else why not."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the kernels need an x86 CPU with AVX2 (torch sees {torch.backends.cpu.get_cpu_capability()})"
    try:
        from torch.utils.cpp_extension import load

        load(name="eagle_cpu_kernels", sources=SOURCES, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             extra_include_paths=[str(HERE)], is_python_module=False)
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, no ninja, a failed build
        log.warning("engine/model/kernels could not be built, the float kernels stay: %s", str(err).splitlines()[0])
        return f"building engine/model/kernels failed: {str(err).splitlines()[0]}"
    return None


def available() -> bool:
    return unavailable_reason() is None
