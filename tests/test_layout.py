"""The package layout draws the architecture: the leaves (progress bar, flags) ← model/ ← draft/ ← decode/ ← the facade ← train/ and
testing/ ← tools/ ← app/.
Each layer imports only the layers below it, so a part can be read, tested and replaced without the ones above."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
# The rank of each part of engine/: a module may import its own rank or lower ones (engine/bench.py is the
# `python -m engine.bench` entry point into tools/).
RANKS = {"progress": 0, "flags": 0, "model": 1, "draft": 2, "decode": 3, "engine": 4, "options": 4, "__init__": 4, "train": 5,
         "testing": 5, "tools": 6, "bench": 6}


def part_of(module: str) -> str:
    """engine.model.quant -> model; engine.engine -> engine; engine -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (relative imports resolved), including imports inside functions."""
    module, package = module_name(path), path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            found.add(source)
            found |= {f"{source}.{alias.name}" for alias in node.names}  # `from . import kernels` imports a module
    return found


ENGINE_FILES = sorted(ENGINE.rglob("*.py"))


def test_every_part_of_engine_has_a_rank():
    assert {part_of(module_name(path)) for path in ENGINE_FILES} <= set(RANKS)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_imports_nothing_above_its_layer(path):
    rank = RANKS[part_of(module_name(path))]
    above = sorted(m for m in imported_modules(path)
                   if (m == "engine" or m.startswith("engine.")) and RANKS.get(part_of(m), rank) > rank)
    assert not above, f"{path.relative_to(ROOT)} (layer {rank}) imports from above its layer: {above}"
    app = sorted(m for m in imported_modules(path) if m == "app" or m.startswith("app."))
    assert not app, f"{path.relative_to(ROOT)} imports the app: {app}"


def test_the_top_of_engine_holds_only_the_facade():
    assert sorted(p.name for p in ENGINE.glob("*.py")) == ["__init__.py", "bench.py", "engine.py", "flags.py", "options.py", "progress.py"]


PLANTED = [("model/bad.py", "from ..decode.loop import decode\nfrom . import quant\n", "engine.decode.loop"),
           ("train/bad.py", "from ..tools.bench import main\n", "engine.tools.bench"),
           ("testing/bad.py", "from engine.tools import runs\n", "engine.tools.runs"),
           ("progress.py", "from .model import load\n", "engine.model.load")]


@pytest.mark.parametrize("where, source, caught", PLANTED, ids=[p[0] for p in PLANTED])
def test_the_checker_sees_a_planted_upward_import(tmp_path, monkeypatch, where, source, caught):
    """The check itself: an import from a higher rank, planted in a copy of the layout, is caught by name."""
    fake = tmp_path / "engine" / where
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert caught in imported_modules(fake)
    with pytest.raises(AssertionError, match=f"above its layer: .*{caught}"):
        test_engine_imports_nothing_above_its_layer(fake)
