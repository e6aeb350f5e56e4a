"""A first start compiles the kernels for about a minute: the log says so and how long it has taken, where a load of
the cached build says nothing."""
from __future__ import annotations

import logging
import time

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
