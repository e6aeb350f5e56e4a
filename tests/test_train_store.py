"""The compact record file (engine.draft.records): shards -> export -> file -> fit / import -> shards, losslessly."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.train.__main__ import main
from engine.train.data import read_shards, write_shards
from engine.draft.records import load_records, save_records


def records(count: int, vocab: int = 49152, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        ids = rng.integers(0, vocab, int(rng.integers(2, 60))).tolist()
        out.append({"id": f"conv{i}", "prompt": [{"role": "user", "content": f"q{i}"}], "input_ids": ids,
                    "prompt_len": int(rng.integers(1, len(ids)))})
    return out


def without_text(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("id", "input_ids", "prompt_len")} for r in rows]


def test_records_round_trip_through_the_file_in_uint16(tmp_path):
    rows = records(40) + [{"id": "top", "input_ids": [0, 65535, 49151], "prompt_len": 1}]
    summary = save_records(rows, tmp_path / "d.npz")
    assert load_records(tmp_path / "d.npz") == without_text(rows)
    with np.load(tmp_path / "d.npz") as data:
        assert data["tokens"].dtype == np.uint16
    assert summary["records"] == 41
    assert summary["reply_tokens"] == sum(len(r["input_ids"]) - r["prompt_len"] for r in rows)


def test_ids_beyond_uint16_are_kept_exactly(tmp_path):
    rows = [{"id": "big", "input_ids": [70000, 3, 151935], "prompt_len": 1}]
    save_records(rows, tmp_path / "d.npz")
    assert load_records(tmp_path / "d.npz") == rows


def test_repeated_ids_and_repeated_conversations_are_stored_once(tmp_path):
    rows = records(5)
    again = dict(rows[1], id="other-id")  # same tokens under another id
    summary = save_records(rows + [rows[3], again], tmp_path / "d.npz")
    assert summary["records"] == 5 and load_records(tmp_path / "d.npz") == without_text(rows)


def test_export_then_fit_input_then_import_gives_the_shards_back(tmp_path, capsys):
    rows = records(30)
    write_shards(tmp_path / "a", rows[:20], shard_size=8)
    write_shards(tmp_path / "b", rows[15:], shard_size=8)  # overlaps a: rows 15-19 twice
    main(["export", "--data", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "x.npz"),
          "--note", "data --limit 30"])
    assert "30 records (5 repeated, 0 held elsewhere left out)" in capsys.readouterr().out
    assert read_shards(tmp_path / "x.npz") == without_text(rows)  # what fit --data FILE.npz reads
    with np.load(tmp_path / "x.npz") as data:
        assert json.loads(str(data["meta"]))["command"] == "data --limit 30"
    write_shards(tmp_path / "c", rows[:4], shard_size=8)  # a resumed folder: records it has are not written again
    main(["import", str(tmp_path / "x.npz"), "--out", str(tmp_path / "c"), "--shard-size", "10"])
    assert without_text(read_shards(tmp_path / "c")) == without_text(rows)
    assert len(list((tmp_path / "c").glob("shard_*.jsonl"))) == 4


def test_a_file_of_another_kind_is_refused_with_the_reason(tmp_path):
    np.savez_compressed(tmp_path / "other.npz", tokens=np.zeros(3, dtype=np.uint16))
    with pytest.raises(ValueError, match="missing ids, meta, offsets, prompt_lens"):
        load_records(tmp_path / "other.npz")
    save_records(records(3), tmp_path / "d.npz")
    with np.load(tmp_path / "d.npz") as data:
        arrays = dict(data)
    np.savez_compressed(tmp_path / "cut.npz", **dict(arrays, tokens=arrays["tokens"][:-1]))
    with pytest.raises(ValueError, match="damaged"):
        load_records(tmp_path / "cut.npz")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="no records"):
        save_records([], tmp_path / "empty.npz")


def test_export_leaves_out_the_records_another_file_holds(tmp_path, capsys):
    rows = records(30)
    save_records(rows[:12], tmp_path / "committed.npz")
    write_shards(tmp_path / "resumed", rows, shard_size=8)  # imported from committed.npz, then resumed
    main(["export", "--data", str(tmp_path / "resumed"), "--exclude", str(tmp_path / "committed.npz"),
          "--out", str(tmp_path / "more.npz")])
    assert "18 records (0 repeated, 12 held elsewhere left out)" in capsys.readouterr().out
    assert read_shards(tmp_path / "more.npz") == without_text(rows[12:])
