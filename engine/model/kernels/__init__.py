"""The engine's own CPU kernels (the C++ beside this file, one job a file: kernels.h lists them): 4- and 8-bit
grouped linear layers (on float32 or int8 activations) and a float32 attention whose rows come out the same bits
whatever shares their forward, and whole forwards built from them (engine.model.fused).

Compiled on first use with torch's extension builder (a C++ compiler and ninja; cached under
~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR, in a folder named after a digest of the sources and flags, so that
an edit, or another checkout whose kernels differ, builds its own rather than loading or overwriting another's) for
x86 CPUs with AVX2 and FMA. Where that cannot happen the engine keeps its float kernels (engine.model.packed,
engine.model.attention's float64 path) and says why once.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(str(source) for source in HERE.glob("*.cpp"))  # each includes kernels.h, from HERE
HEADERS = sorted(str(header) for header in HERE.glob("*.h"))
# No contraction the source does not ask for; OpenMP, without which every kernel runs on one thread.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
SILENT_S = 2.0  # a load of the cached build takes less: longer means it compiles
PROGRESS_S = 15.0


@functools.cache
def unavailable_reason() -> str | None:
    """None when torch.ops.eagle_cpu is loaded (building it on first call), else why not."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the kernels need an x86 CPU with AVX2 (torch sees {torch.backends.cpu.get_cpu_capability()})"
    try:
        from torch.utils.cpp_extension import load

        with _said_while_building():
            load(name=build_name(), sources=SOURCES, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                 extra_include_paths=[str(HERE)], is_python_module=False)
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, no ninja, a failed build
        log.warning("engine/model/kernels could not be built, the float kernels stay: %s", str(err).splitlines()[0])
        return f"building engine/model/kernels failed: {str(err).splitlines()[0]}"
    return None


def build_name() -> str:
    """The extension's name in torch's cache: eagle_cpu_kernels and a digest of every source, header and flag."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for path in (*SOURCES, *HEADERS):
        digest.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    return f"eagle_cpu_kernels_{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _said_while_building() -> Iterator[None]:
    """Log what a first start spends its first minute on: a build (a cached one loads in well under SILENT_S) is
    announced, then its progress every PROGRESS_S, so that a start that compiles is never silent."""
    done, start = threading.Event(), time.monotonic()

    def report() -> None:
        if done.wait(SILENT_S):
            return
        log.info("compiling the engine's C++ kernels (engine/model/kernels, %d files): once per version, about a "
                 "minute on 2 cores", len(SOURCES))
        while not done.wait(PROGRESS_S):
            log.info("still compiling the kernels: %.0f s so far", time.monotonic() - start)

    reporter = threading.Thread(target=report, name="kernel-build", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
        if time.monotonic() - start > SILENT_S:
            log.info("kernels compiled in %.0f s (kept in torch's extension cache)", time.monotonic() - start)


def available() -> bool:
    return unavailable_reason() is None
