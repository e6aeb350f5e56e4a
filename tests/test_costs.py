"""engine.decode.costs.row_cost: a verified row's price in plain steps, measured once per machine and model shape and
read back after, and measured still where the cache folder cannot be written."""
import json

import pytest

from conftest import tiny_engine
from engine.decode import costs


def test_the_row_cost_is_measured_once_and_kept_by_machine_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path))
    measured = []
    curve = costs.verification_curve
    monkeypatch.setattr(costs, "verification_curve", lambda *a, **k: measured.append(a[1]) or curve(*a, **k))
    target = tiny_engine("llama-h64-l8-gqa", None).target
    first = costs.row_cost(target)
    assert first >= 0 and measured == [costs.ROW_COST_SIZES]
    kept = json.loads((tmp_path / "row-costs.json").read_text())
    [key] = kept
    assert kept[key] == first and "threads" in key and "llama 8x64" in key
    kept[key] = 0.125  # what is kept is what a later engine of that shape on this machine uses
    (tmp_path / "row-costs.json").write_text(json.dumps(kept))
    assert costs.row_cost(tiny_engine("llama-h64-l8-gqa", "eagle3").target) == 0.125 and len(measured) == 1
    costs.row_cost(tiny_engine("qwen2-h32-l10-tied", None).target)  # another shape: measured, kept beside
    assert len(measured) == 2 and len(json.loads((tmp_path / "row-costs.json").read_text())) == 2


@pytest.mark.parametrize("damage", ["unreadable", "unwritable"])
def test_a_damaged_or_unwritable_cache_is_measured_again(tmp_path, monkeypatch, damage):
    folder = tmp_path / "cache"
    if damage == "unreadable":
        folder.mkdir()
        (folder / "row-costs.json").write_text("{not json")
    else:
        folder.write_text("a file where the folder should be")
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(folder))
    assert costs.row_cost(tiny_engine("llama-h64-l8-gqa", None).target) >= 0
