"""A first start compiles the kernels for about a minute: the log says so and how long it has taken, where a load of
the cached build says nothing; the build is named after its sources."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from engine.model import kernels


def test_a_long_build_is_announced_with_its_progress_and_a_quick_load_is_silent(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "SILENT_S", 0.05)
    monkeypatch.setattr(kernels, "PROGRESS_S", 0.1)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        with kernels._said_while_building():
            time.sleep(0.5)  # a build: ten times the silent spell
    said = [record.getMessage() for record in caplog.records]
    assert said[0].startswith("compiling the engine's C++ kernels") and "about a minute" in said[0]
    assert any(line.startswith("still compiling the kernels") for line in said[1:-1])
    assert said[-1].startswith("kernels compiled in")
    caplog.clear()
    monkeypatch.setattr(kernels, "SILENT_S", 5.0)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        with kernels._said_while_building():
            pass  # the cached build loads at once
    assert caplog.records == []


def test_the_build_is_named_after_its_sources(tmp_path, monkeypatch):
    """Kernels whose sources differ (an edit, another checkout) build under another name in torch's cache, so that
    neither loads nor overwrites the other's build; the same sources keep the name."""
    names = []
    for copy, edit in (("same", ""), ("edited", "\n// an edit\n")):
        folder = tmp_path / copy
        folder.mkdir()
        for path in map(Path, kernels.SOURCES + kernels.HEADERS):
            (folder / path.name).write_text(path.read_text() + (edit if path.name == "kernels.h" else ""))
        monkeypatch.setattr(kernels, "SOURCES", sorted(str(path) for path in folder.glob("*.cpp")))
        monkeypatch.setattr(kernels, "HEADERS", sorted(str(path) for path in folder.glob("*.h")))
        names.append(kernels.build_name())
    monkeypatch.undo()
    assert names[0] == kernels.build_name() != names[1]
