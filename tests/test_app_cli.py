"""app.py's command line (options, their checks, clear errors) and the README front matter that Spaces reads."""
from __future__ import annotations

import gc
import importlib.util
import re
from pathlib import Path

import pytest
import yaml  # comes with gradio

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def main_module():
    """app.py itself (the name `app` belongs to the package beside it)."""
    spec = importlib.util.spec_from_file_location("app_main", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_leave_host_and_port_to_gradio_and_spaces(main_module):
    args = main_module.parse_args([])
    assert (args.base, args.head, args.device, args.host, args.port, args.share, args.auth) == (
        None, "default", "auto", None, None, False, None
    )
    assert args.max_new_tokens is None and args.quantization == "none"  # None: as long as the context holds


def test_options(main_module):
    args = main_module.parse_args(
        ["--head", "none", "--share", "--auth", "ann:pa:ss", "--auth", "bob:pw", "--port", "7999", "--host", "0.0.0.0",
         "--max-new-tokens", "32", "--data-dir", "/tmp/chats"]
    )
    assert args.auth == [("ann", "pa:ss"), ("bob", "pw")] and args.share and args.port == 7999
    assert args.max_new_tokens == 32 and args.data_dir == Path("/tmp/chats") and args.models_dir is None


@pytest.mark.parametrize("argv, message", [
    (["--auth", "nopassword"], "--auth takes user:password"),
    (["--auth", ":secret"], "--auth takes user:password"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--quantization", "3bit"], "invalid choice"),
])
def test_bad_options_are_refused_clearly(main_module, capsys, argv, message):
    with pytest.raises(SystemExit):
        main_module.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_load_error_stops_the_app_with_one_clear_line(main_module, monkeypatch):
    def refuse(*args, **kwargs):
        raise main_module.CheckpointError("head /x does not fit base model y")

    monkeypatch.setattr(main_module.Engine, "from_options", refuse)
    with pytest.raises(SystemExit, match=r"^app.py: error: head /x does not fit base model y$"):
        main_module.main(["--head", "/x"])


@pytest.mark.parametrize("argv, message", [
    (["--corpus", "/no/such.npz"], "record file /no/such.npz does not exist"),
    (["--corpus", "default", "/x.npz"], '--corpus takes "default", "none" or files, not a mix'),
])
def test_a_bad_corpus_stops_the_app_before_the_model_loads(main_module, monkeypatch, argv, message):
    monkeypatch.setattr("engine.engine.load_target", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=f"^app.py: error: {re.escape(message)}$"):
        main_module.main(argv)


def test_the_loaded_engine_is_out_of_the_collectors_sight(main_module, monkeypatch):
    """A full collection walking start-up's objects would stall an answer's step by ~0.25 s (engine.freeze_heap)."""
    from app.chat import EngineThread
    from tests.conftest import IdsOnlyTokenizer, tiny_base

    engine = main_module.Engine.over(tiny_base("llama-h64-l8-gqa"), IdsOnlyTokenizer())
    monkeypatch.setattr(main_module.Engine, "from_options", lambda *args, **kwargs: engine)
    try:
        service = main_module.load_service(main_module.parse_args([]), EngineThread())
        walked = {id(o) for o in gc.get_objects()}
        assert service.engine is engine and not walked & {id(engine), id(engine.model), id(engine.target)}
    finally:
        gc.unfreeze()


def test_readme_front_matter_deploys_the_repo_as_a_gradio_space():
    """Spaces reads the README's YAML front matter: the SDK, its version (the Gradio we pin) and the entry point."""
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("---\n"), "README.md must open with the Spaces front matter"
    front = yaml.safe_load(readme.split("---\n")[1])
    pin = re.search(r"^gradio==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert front["sdk"] == "gradio" and str(front["sdk_version"]) == pin
    assert (ROOT / front["app_file"]).is_file() and front["app_file"] == "app.py"
