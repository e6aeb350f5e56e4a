"""The benchmark command end to end on a tiny random Llama with the real SmolLM2 tokenizer and a random EAGLE-3 head."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tokens_of
from engine import DecodeParams, Engine
from engine.tools.bench import BURST_S, BUSY_LOOP, METHODS, busy_processes, exactness_exempt, main
from engine.tools.report import exactness_warnings, print_table, summarize
from engine.tools.runs import Run
from engine.tools import tune_tree
from engine.draft.records import save_records
from engine.draft.tree import DynamicTree
from engine.draft.checkpoint import new_head, save_head
from engine.model.load import auto_dtype, load_tokenizer

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about the sea.", "Now a longer one."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 12? Explain step by step."]},
]
MAX_NEW = 6


def _bigram_base(config: LlamaConfig) -> LlamaForCausalLM:
    """A base model whose layers add nothing (zero output projections): its next token depends on the last only."""
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _bigram_drafter(config: LlamaConfig):
    """An EAGLE-1 head whose output is the embedding of the token it reads. Through the base LM head that ranks
    tokens as the bigram base does (its final norm only rescales that embedding), so its drafts are the base's
    own greedy tokens: they are accepted, and tau is well above 1."""
    head = new_head("eagle1", config)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, : config.hidden_size] = torch.eye(config.hidden_size)  # [embedding, feature] -> embedding
        head.fc.bias.zero_()
        for layer in head.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return head


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny bigram base model folder (tokenizer saved next to it), a random EAGLE-3 head, an EAGLE-1 head that
    drafts the base's own tokens, and a 2-question file."""
    root = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
    )
    model = _bigram_base(config)
    model.save_pretrained(root / "base")
    load_tokenizer().save_pretrained(root / "base")
    save_head(new_head("eagle3", config), root / "head")
    save_head(_bigram_drafter(config), root / "head1")
    questions = root / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return root


@pytest.fixture(scope="module")
def report(assets):
    argv = [
        "--base", str(assets / "base"), "--head", str(assets / "head"), "--questions", str(assets / "questions.jsonl"),
        "--max-new-tokens", str(MAX_NEW), "--methods", ",".join(METHODS), "--compare-head", f"e1={assets / 'head1'}",
        "--total-tokens", "6", "--depth", "2", "--draft-top-k", "3",
        "--min-prob", "0",  # no floor at this CPU's measured row cost: what is drafted depends on no machine's speed
        "--dtype", "float32",  # where hf (transformers' kernels) must equal vanilla too
        # folders not there yet
        "--json", str(assets / "runs" / "out.json"), "--plot", str(assets / "plots" / "out.png"),
    ]
    return main(argv)


def test_json_schema_and_tau(assets, report):
    saved = json.loads((assets / "runs" / "out.json").read_text())
    assert saved["summary"].keys() == {*METHODS, "e1"}
    assert saved["config"]["compare_heads"] == {"e1": str(assets / "head1")}
    assert saved["config"]["packed"] is True  # the engine packs; hf and hf-pld ran on an unpacked copy
    for method, s in saved["summary"].items():
        for key in ("tokens", "wall_s", "tokens_per_s", "tau", "draft_ms", "verify_ms", "other_ms", "rows_per_round",
                    "matches_vanilla"):
            assert key in s, (method, key)
        assert s["tokens"] == sum(len(q["results"][method]["token_ids"]) for q in saved["questions"])
        assert s["wall_s"] > 0 and s["tokens_per_s"] == pytest.approx(s["tokens"] / s["wall_s"])
    assert [q["question_id"] for q in saved["questions"]] == [1, 2]
    for q in saved["questions"]:
        for method in (*METHODS, "e1"):
            result = q["results"][method]
            assert 1 <= len(result["token_ids"]) <= MAX_NEW and result["wall_s"] > 0 and result["target_forwards"] >= 1
    assert saved["summary"]["vanilla"]["tau"] == 1.0 and saved["summary"]["vanilla"]["speedup_vs_vanilla"] == 1.0
    assert saved["summary"]["hf"]["tau"] == 1.0  # plain generate: one forward per token, counted by the hook
    assert saved["summary"]["eagle"]["draft_ms"] > 0 and saved["summary"]["hf"]["draft_ms"] is None
    assert saved["summary"]["vanilla"]["rows_per_round"] == 1.0 and saved["summary"]["hf"]["rows_per_round"] is None
    assert saved["summary"]["eagle"]["rows_per_round"] > 1 + saved["summary"]["eagle"]["accepted_per_round"] - 1e-9
    assert saved["summary"]["e1"]["draft_ms"] > 0  # the EAGLE-1 head drafted
    assert saved["summary"]["eagle-gated"]["draft_ms"] > 0  # its head drafted in the gate's first window at least
    assert saved["config"]["busy_cores"] == 0 and saved["config"]["busy_cores_measured"] is None


def test_tau_is_new_tokens_per_round_of_the_engine_run_alone(assets, report):
    """tau pools the questions' new tokens and rounds, the prefill left out, and they must be what the engine does
    on its own; the EAGLE-1 head gets drafts accepted here, where a miscount cannot hide behind tau = 1."""
    engine = Engine.load(str(assets / "base"), str(assets / "head1"), dtype="float32")
    params = DecodeParams().with_options(max_new_tokens=MAX_NEW, total_tokens=6, depth=2, draft_top_k=3, min_prob=0.0)
    produced = rounds = 0
    for question, saved in zip(QUESTIONS, report["questions"], strict=True):
        steps = list(engine.generate(engine.encode_chat([{"role": "user", "content": question["turns"][0]}]), params))
        assert saved["results"]["e1"]["token_ids"] == tokens_of(steps)
        assert saved["results"]["e1"]["target_forwards"] == len(steps)
        produced, rounds = produced + len(tokens_of(steps)) - 1, rounds + len(steps) - 1
    assert produced / rounds > 1.5, "the bigram drafter's drafts should be accepted"
    assert report["summary"]["e1"]["tau"] == pytest.approx(produced / rounds)


def test_tau_by_category_pools_each_categorys_questions():
    runs = [Run(list(range(5)), 1.0, 3), Run(list(range(3)), 1.0, 3), Run(list(range(7)), 1.0, 3)]  # tau 2, 1, 3
    summary = summarize(runs, None, ["writing", "math", "writing"])
    assert summary["tau_by_category"] == {"writing": (4 + 6) / (2 + 2), "math": 1.0}
    assert summary["tau"] == (4 + 2 + 6) / 6


def test_tau_by_category_is_reported(report, capsys):
    assert all(list(s["tau_by_category"]) == ["writing", "math"] for s in report["summary"].values())
    assert report["summary"]["vanilla"]["tau_by_category"] == {"writing": 1.0, "math": 1.0}
    print_table(report["summary"], len(QUESTIONS))
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("tau by category") + 1
    assert lines[header].split() == ["method", "writing", "math"]
    assert lines[header + 1].split() == ["vanilla", "1.00", "1.00"]


def test_greedy_methods_equal_vanilla(report):
    for q in report["questions"]:
        vanilla = q["results"]["vanilla"]["token_ids"]
        for method in ("eagle", "eagle-gated", "hf", "hf-pld", "e1"):
            assert q["results"][method]["token_ids"] == vanilla, (q["question_id"], method)
    assert all(s["matches_vanilla"] == len(QUESTIONS) for s in report["summary"].values())


def test_mismatch_is_warned():
    summary = {"vanilla": {"matches_vanilla": 3}, "eagle": {"matches_vanilla": 2}, "hf": {"matches_vanilla": None}}
    assert exactness_warnings(summary, 3) == [
        "WARNING: eagle matched vanilla's greedy tokens on only 2/3 questions (expected all at temperature 0)"
    ]
    summary["hf"]["matches_vanilla"] = 1  # hf in another dtype than the engine: reported, not warned
    assert len(exactness_warnings(summary, 3, exempt={"hf"})) == 1


def test_hf_is_held_to_vanilla_tokens_only_where_it_runs_the_engines_model():
    config = {"methods": ["vanilla", "eagle", "hf", "llama.cpp"], "dtype": "float32", "hf_dtype": "float32",
              "kernels": "float"}
    assert exactness_exempt(config) == {"llama.cpp"}
    assert exactness_exempt({**config, "kernels": "int8"}) == {"hf", "llama.cpp"}  # hf: float weights, not groups
    assert exactness_exempt({**config, "hf_dtype": "bfloat16"}) == {"hf", "llama.cpp"}


def test_hf_can_run_in_another_dtype(assets, capsys):
    report = main([
        "--base", str(assets / "base"), "--head", "none", "--questions", str(assets / "questions.jsonl"),
        "--max-new-tokens", str(MAX_NEW), "--methods", "vanilla,hf", "--dtype", "bfloat16", "--hf-dtype", "float32",
    ])
    assert report["config"]["dtype"] == "bfloat16" and report["config"]["hf_dtype"] == "float32"
    assert report["summary"]["hf"]["tau"] == 1.0
    assert "note: hf ran in float32, the engine in bfloat16" in capsys.readouterr().out


def test_plot_is_png(assets, report):
    assert (assets / "plots" / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_method_is_refused(assets, capsys):
    with pytest.raises(SystemExit):
        main(["--questions", str(assets / "questions.jsonl"), "--methods", "vanilla,medusa"])
    err = capsys.readouterr().err
    assert "unknown method 'medusa'" in err and "hf-pld" in err


def test_negative_load_is_refused(assets, capsys):
    with pytest.raises(SystemExit):
        main(["--questions", str(assets / "questions.jsonl"), "--busy", "-0.5"])
    assert "--busy is a number of cores" in capsys.readouterr().err


@pytest.mark.parametrize("load, shares", [(0.3, [0.3]), (1.3, [1.0, 0.3]), (0, [])])
def test_busy_processes_run_one_process_per_core_asked_for_while_the_block_runs(load, shares, capsys):
    """A `while True` loop per whole core and one partly busy process for the fractional part, all running while the
    block runs and gone after it; then the cores they used are reported (how many depends on the machine's other
    work: the bench prints the figure, no test bounds it)."""
    with busy_processes(load) as busy:
        assert busy.shares == pytest.approx(shares)
        assert len(busy.processes) == len(shares)
        assert all(process.poll() is None for process in busy.processes), "each runs while the block does"
    for share, process in zip(shares, busy.processes, strict=True):
        if share == 1:
            assert process.args[1:] == ["-c", "while True: pass"]
        else:
            assert process.args[1:3] == ["-c", BUSY_LOOP] and float(process.args[3]) == pytest.approx(share)
        assert process.returncode is not None, "the block's end ends it"
    out = capsys.readouterr().out
    if shares:
        assert busy.measured is not None and busy.measured >= 0
        assert out == f"busy load: asked {load:.2f} cores, measured {busy.measured:.2f}\n"
    else:
        assert busy.measured is None and out == ""


class _Done(Exception):
    pass


@pytest.mark.parametrize("share", [0.3, 0.75])
def test_a_partly_busy_process_works_its_share_of_the_time_in_bursts(share):
    """The partly busy process's program on a clock that advances only when read or slept on: each cycle is a burst
    of BURST_S of work, then a rest that makes the work `share` of the cycle."""
    program = {"__name__": "busy_loop"}
    exec(BUSY_LOOP, program)
    now, cycles = [0.0], []  # (work, rest) of each cycle

    def clock() -> float:
        now[0] += 1e-5
        return now[0]

    def sleep(seconds: float) -> None:
        work = now[0] - sum(w + r for w, r in cycles)
        cycles.append((work, seconds))
        now[0] += seconds
        if len(cycles) == 5:
            raise _Done

    with pytest.raises(_Done):
        program["loop"](share, BURST_S, clock, sleep)
    for work, rest in cycles:
        assert work == pytest.approx(BURST_S, abs=3e-5)  # the burst, and the clock readings that end it
        assert work / (work + rest) == pytest.approx(share, rel=0.01)


def test_the_bench_reports_the_cores_its_busy_processes_used(assets, capsys):
    report = main(["--base", str(assets / "base"), "--head", "none", "--questions", str(assets / "questions.jsonl"),
                   "--max-new-tokens", "2", "--methods", "vanilla", "--busy", "0.2"])
    measured = report["config"]["busy_cores_measured"]
    assert report["config"]["busy_cores"] == 0.2 and measured >= 0
    out = capsys.readouterr().out
    assert f"busy load: asked 0.20 cores, measured {measured:.2f}" in out
    assert out.index("busy load:") < out.index("tok/s"), "the line follows the timed runs, before the table"


def test_missing_head_is_refused(assets, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--base", str(assets / "base"), "--head", str(tmp_path / "nowhere"),
              "--questions", str(assets / "questions.jsonl")])
    assert "nowhere" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("e1", "takes NAME=HEAD"), ("eagle=x", "already a method"), ("=x", "takes NAME=HEAD"),
])
def test_bad_compare_head_is_refused(assets, capsys, spec, message):
    with pytest.raises(SystemExit):
        main(["--questions", str(assets / "questions.jsonl"), "--compare-head", spec])
    assert message in capsys.readouterr().err


def test_compare_head_that_does_not_fit_is_named(assets, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--base", str(assets / "base"), "--head", "none", "--questions", str(assets / "questions.jsonl"),
              "--methods", "vanilla", "--compare-head", f"e1={tmp_path / 'nowhere'}"])
    assert "--compare-head e1:" in capsys.readouterr().err


def test_malformed_question_line_is_named(assets, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(QUESTIONS[0]) + "\n\n" + '{"question_id": 2, "turns": ["hi"]\n')
    with pytest.raises(SystemExit):
        main(["--questions", str(bad), "--methods", "vanilla"])
    assert f"{bad} line 3: not valid JSON" in capsys.readouterr().err

    bad.write_text(json.dumps({"question_id": 2, "turns": ["hi"]}) + "\n")
    with pytest.raises(SystemExit):
        main(["--questions", str(bad), "--methods", "vanilla"])
    assert f"{bad} line 1: missing category" in capsys.readouterr().err


def test_verification_curve_times_each_tree_size(assets, capsys):
    report = main(["--base", str(assets / "base"), "--head", "none", "--questions", str(assets / "questions.jsonl"),
                   "--verify-curve", "1,4,12", "--verify-cache", "20,60"])
    rows = report["verification_curve"]
    assert [(r["cache_tokens"], r["tree_tokens"]) for r in rows] == [(20, 1), (20, 4), (20, 12), (60, 1), (60, 4),
                                                                     (60, 12)]
    assert rows[0]["ratio"] == rows[3]["ratio"] == 1.0 and all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert "x one-token step" in capsys.readouterr().out


def test_bad_curve_sizes_are_refused(assets, capsys):
    with pytest.raises(SystemExit):
        main(["--questions", str(assets / "questions.jsonl"), "--verify-curve", "1,eight"])
    assert "comma-separated tree sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--questions", str(assets / "questions.jsonl"), "--verify-curve", "1,8", "--verify-cache", "0"])
    assert "--verify-cache: every value must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", ["float", "q4", "int8"])
def test_hf_runs_transformers_own_layers_whatever_the_engines_kernels(kernels, tmp_path):
    """hf measures transformers itself: never the engine's packed or 4-bit layers (on q4 it once ran the engine's
    own model, and looked as fast as the engine)."""
    from engine.model import kernels as engine_kernels
    from engine.model.packed import PackedLinear
    from engine.model.quant import QuantLinear
    from engine.tools.bench import build_parser, hf_model_for

    if kernels != "float" and not engine_kernels.available():
        pytest.skip(f"engine/model/kernels: {engine_kernels.unavailable_reason()}")
    engine = Engine.load(head=None, kernels=kernels)
    questions = tmp_path / "q.jsonl"  # a checkout without ../shared/bench must be able to run this too
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["Hi"]}\n')
    args = build_parser().parse_args(["--methods", "hf", "--questions", str(questions)])
    model = hf_model_for(args, engine, ["hf"])
    assert model is not engine.model
    assert not any(isinstance(m, (PackedLinear, QuantLinear)) for m in model.modules())
    # in transformers' faster dtype: the engine's on the float path; beside q4 (float32 for the kernels' sake)
    # the one the float path would take, bfloat16 where the CPU multiplies it natively
    expected = auto_dtype("cpu") if kernels != "float" else str(engine.model.dtype).removeprefix("torch.")
    assert str(model.dtype).removeprefix("torch.") == expected


def test_tune_tree_grid_holds_every_setting_that_can_fill_its_budget():
    grid = tune_tree.tree_grid("2,6", "1,5", "1,2", "0,0.2")
    assert DynamicTree(6, 5, 1, 0.2) in grid and DynamicTree(2, 1, 2, 0.0) in grid
    assert DynamicTree(6, 1, 1, 0.0) not in grid, "5 drafts cannot fit in two levels of one child each"
    assert len(grid) == len(set(grid)) == 14


def test_tune_tree_times_every_tree_with_every_context_policy(assets, capsys, tmp_path):
    corpus = tmp_path / "replies.npz"
    save_records([{"id": str(i), "input_ids": list(range(i, i + 20)), "prompt_len": 2} for i in range(20)], corpus)
    tune_tree.main(["--base", str(assets / "base"), "--head", str(assets / "head"), "--dtype", "float32",
                    "--questions", str(assets / "questions.jsonl"), "--max-new-tokens", str(MAX_NEW),
                    "--total-tokens", "2,3", "--depth", "1", "--draft-top-k", "2", "--min-match", "1,3",
                    "--methods", "eagle,suffix", "--corpus", str(corpus), "--corpus-share", "off,0.5"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    settings = {(row[0], row[1], row[5], row[6]) for row in rows}
    contexts = {(m, c) for m in ("1", "3") for c in ("off", "0.50x1")}
    assert settings == {("eagle", t, m, c) for t in ("2", "3") for m, c in contexts} | {
        ("suffix", "-", m, c) for m, c in contexts}
    assert len(rows) == len(settings) == 12
    assert all(row[-1] == f"{len(QUESTIONS)}/{len(QUESTIONS)}" for row in rows), "every answer is vanilla's"
