"""The engine's own CPU kernels (cpu.cpp): 4- and 8-bit grouped linear layers (on float32 or int8 activations) and
a float32 attention whose rows come out the same bits whatever shares their forward, and whole forwards built from
them (engine.model.fused).

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
SOURCE = Path(__file__).with_name("cpu.cpp")
# No contraction the source does not ask for; OpenMP, or at::parallel_for runs every kernel on one thread.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def unavailable_reason() -> str | None:
    """None when torch.ops.eagle_cpu is loaded (building it on first call), else why not."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the kernels need an x86 CPU with AVX2 (torch sees {torch.backends.cpu.get_cpu_capability()})"
    try:
        from torch.utils.cpp_extension import load

        load(name="eagle_cpu_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, no ninja, a failed build
        log.warning("engine/model/kernels could not be built, the float kernels stay: %s", str(err).splitlines()[0])
        return f"building engine/model/kernels/cpu.cpp failed: {str(err).splitlines()[0]}"
    return None


def available() -> bool:
    return unavailable_reason() is None
