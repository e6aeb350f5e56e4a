"""The package layout draws the architecture: model/ ← draft/ ← decode/ ← the facade ← tools/ and train/ ← app/.
Each layer imports only the layers below it, so a part can be read, tested and replaced without the ones above."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
# The rank of each part of engine/: a module may import its own rank or lower ones (engine/bench.py is the
# `python -m engine.bench` entry point into tools/).
RANKS = {"model": 0, "draft": 1, "decode": 2, "engine": 3, "options": 3, "__init__": 3, "bench": 4,
         "tools": 4, "train": 4}


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
    assert sorted(p.name for p in ENGINE.glob("*.py")) == ["__init__.py", "bench.py", "engine.py", "options.py"]


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself: a model/ module importing the decode loop is caught."""
    fake = tmp_path / "engine" / "model" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from ..decode.loop import decode\nfrom . import quant\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert "engine.decode.loop" in imported_modules(fake)
    with pytest.raises(AssertionError, match="above its layer"):
        test_engine_imports_nothing_above_its_layer(fake)
