"""Benchmark decoding methods side by side on MT-bench style prompts: speed, acceptance and exactness.

Methods:
  vanilla  the engine without drafting, one base forward per token: the honest baseline
  eagle    the engine with its draft head (EAGLE trees, lossless verification)
  hf       transformers `generate` on the same model, as transformers runs it (stock layers, SDPA attention), in
           the engine's dtype or --hf-dtype's (say float32, transformers' fastest on a CPU where the engine runs bf16)
  hf-pld   transformers prompt lookup decoding (prompt_lookup_num_tokens=10)
  NAME     with --compare-head NAME=HEAD: the engine drafting with another head (say an EAGLE-1 head beside the
           shipped EAGLE-3 one), on the same base model in the same run

On the CPU the engine's linear layers are packed for oneDNN (engine/packed.py; --no-pack turns that off), so
hf and hf-pld get a second, unpacked copy of the model: they measure transformers itself.

Each question's first turn goes through the chat template. Methods alternate question by question, in an order
that rotates per question, so a noisy machine slows them all alike; each method first runs one short untimed
warm-up generation.

tau = new tokens per decoding forward of the base model. The prefill forward and the token it produces are left
out, so tau = (tokens - 1) / (forwards - 1), summed over questions: plain decoding gives exactly 1.0, and a
speculative method's tau is its mean accepted length (accepted drafts + the base model's own token per round).
Per-round times (draft, verify, other) are means over decoding rounds, prefill excluded.

--json writes config, summary.<method> = {tokens, wall_s, tokens_per_s, tau, tau_by_category, rounds, draft_ms,
verify_ms, other_ms, accepted_per_round, matches_vanilla, speedup_vs_vanilla} and questions[i] = {question_id, category,
prompt_tokens, results.<method> = {token_ids, wall_s, target_forwards}}. At temperature 0 every method must
reproduce vanilla's tokens exactly; a WARNING line says which did not. hf methods are held to that only in float32
and the engine's dtype: transformers' own kernels round bf16/fp16 differently from the engine's (exact) ones.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TextIO

import torch
import transformers
from transformers import PreTrainedModel
from tqdm import tqdm

from . import Engine
from .costs import verification_curve
from .draft.checkpoint import DEFAULT_HEAD
from .generate import TREES, DecodeParams, Step
from .models import DTYPES, QUANTIZATIONS, load_base

METHODS = ("vanilla", "eagle", "hf", "hf-pld")
PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 8
COLORS = {"vanilla": "#7f7f7f", "eagle": "#d62728", "hf": "#1f77b4", "hf-pld": "#2ca02c"}
SHARED_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "mt_bench.jsonl"


@dataclass
class Run:
    """One method on one prompt: what it produced, how long it took, how many base forwards it needed."""

    token_ids: list[int]
    wall_s: float
    target_forwards: int
    steps: list[Step] = field(default_factory=list)  # engine methods only


def load_questions(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read MT-bench JSON lines ({question_id, category, turns}); a bad line is an error naming its number."""
    path = Path(path)
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with question_id, category and turns")
        missing = [key for key in ("question_id", "category", "turns") if key not in record]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: turns must be a non-empty list of strings")
        if not turns[0].strip():
            raise ValueError(f"{where}: the first turn is empty")
        questions.append(record)
        if limit is not None and len(questions) == limit:
            break
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {', '.join(map(repr, unknown))}; choose among {', '.join(METHODS)}")
    if not methods:
        raise ValueError(f"no method given; choose among {', '.join(METHODS)}")
    return list(dict.fromkeys(methods))


@contextmanager
def count_forwards(module: torch.nn.Module):
    """Count calls of `module` (the base model's decoder) while the block runs."""
    calls = [0]
    hook = module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        hook.remove()


def run_engine(engine: Engine, method: str, prompt: list[int], params: dict) -> Run:
    start = time.perf_counter()
    steps = list(engine.generate(prompt, method, **params))
    wall = time.perf_counter() - start
    return Run([tok for step in steps for tok in step.tokens], wall, len(steps), steps)


def run_hf(engine: Engine, model: PreTrainedModel, prompt: list[int], params: dict, lookup: bool) -> Run:
    """transformers `generate`, its output cut after the first stop token as the engine's Step stream is."""
    temperature = params["temperature"]
    kwargs = dict(
        max_new_tokens=params["max_new_tokens"],
        eos_token_id=list(engine.stop_ids),
        pad_token_id=engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else engine.stop_ids[0],
        do_sample=temperature > 0,
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        if params["seed"] is not None:
            torch.manual_seed(params["seed"])
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    ids = torch.tensor([prompt], device=model.device)
    with count_forwards(model.get_decoder()) as calls, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        if out.is_cuda:  # kernels may still be queued; the engine's Steps hold Python ints, so they are done
            torch.cuda.synchronize(out.device)
        wall = time.perf_counter() - start
    tokens = out[0, len(prompt):].tolist()[: params["max_new_tokens"]]
    stop = next((i for i, tok in enumerate(tokens) if tok in engine.stop_ids), None)
    return Run(tokens if stop is None else tokens[: stop + 1], wall, calls[0])


def parse_compare_heads(specs: list[str]) -> dict[str, str]:
    """--compare-head NAME=HEAD options as {method name: head}; a name may not shadow a method or repeat."""
    heads: dict[str, str] = {}
    for spec in specs:
        name, sep, head = spec.partition("=")
        name, head = name.strip(), head.strip()
        if not sep or not name or not head:
            raise ValueError(f"--compare-head takes NAME=HEAD (say eagle1=runs/e1/head), got {spec!r}")
        if name in METHODS or name in heads:
            raise ValueError(f"--compare-head name {name!r} is already a method; pick another")
        heads[name] = head
    return heads


def run_method(engines: dict[str, Engine], hf_model: PreTrainedModel, method: str, prompt: list[int],
               params: dict) -> Run:
    """engines: the main engine under "vanilla" and "eagle", and one per --compare-head name."""
    if method in engines:
        return run_engine(engines[method], "vanilla" if method == "vanilla" else "eagle", prompt, params)
    return run_hf(engines["vanilla"], hf_model, prompt, params, lookup=method == "hf-pld")


def _mean_ms(values: list[float]) -> float | None:
    return 1000 * sum(values) / len(values) if values else None


def _tau(runs: list[Run]) -> float | None:
    """New tokens per decoding forward, prefill and its token left out (module docstring)."""
    decode_forwards = sum(r.target_forwards - 1 for r in runs)
    return sum(len(r.token_ids) - 1 for r in runs) / decode_forwards if decode_forwards else None


def summarize(runs: list[Run], baseline: list[Run] | None, categories: list[str]) -> dict:
    """Totals over questions for one method; see the module docstring for tau and the per-round split.

    categories[i] is question i's; tau_by_category shows what kind of text drafts well (MT-bench's first 20
    questions, the usual quick run, are all writing and roleplay).
    """
    tokens = sum(len(r.token_ids) for r in runs)
    wall = sum(r.wall_s for r in runs)
    rounds = [step for r in runs for step in r.steps[1:]]  # engine methods only
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "tau": _tau(runs),
        "tau_by_category": {
            name: _tau([r for r, c in zip(runs, categories) if c == name]) for name in dict.fromkeys(categories)
        },
        "rounds": sum(r.target_forwards - 1 for r in runs),
        "draft_ms": _mean_ms([s.draft_s for s in rounds]),
        "verify_ms": _mean_ms([s.verify_s for s in rounds]),
        "other_ms": _mean_ms([s.wall_s - s.draft_s - s.verify_s for s in rounds]),
        "accepted_per_round": sum(s.accepted for s in rounds) / len(rounds) if rounds else None,
        "matches_vanilla": (
            sum(r.token_ids == b.token_ids for r, b in zip(runs, baseline)) if baseline is not None else None
        ),
    }


def exactness_warnings(summary: dict, questions: int, exempt: set[str] = frozenset()) -> list[str]:
    """Greedy decoding is lossless only if every method reproduces vanilla's tokens on every question; `exempt`
    names methods that ran another model dtype, where no one expects the same tokens."""
    return [
        f"WARNING: {method} matched vanilla's greedy tokens on only {s['matches_vanilla']}/{questions} questions "
        "(expected all at temperature 0)"
        for method, s in summary.items()
        if s["matches_vanilla"] is not None and s["matches_vanilla"] != questions and method not in exempt
    ]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_speedups(summary: dict) -> None:
    """tokens/s of each method over vanilla's, where vanilla ran."""
    vanilla = summary.get("vanilla", {}).get("tokens_per_s")
    for s in summary.values():
        s["speedup_vs_vanilla"] = s["tokens_per_s"] / vanilla if vanilla and s["tokens_per_s"] else None


def print_table(summary: dict, questions: int, file: TextIO | None = None) -> None:
    """The summary as aligned columns on `file` (None: sys.stdout at call time), then tau by category if several."""
    rows = [("method", "tokens", "wall s", "tok/s", "x vanilla", "tau", "acc/round",
             "draft ms", "verify ms", "other ms", "= vanilla")]
    for method, s in summary.items():
        match = "-" if s["matches_vanilla"] is None else f"{s['matches_vanilla']}/{questions}"
        rows.append((method, str(s["tokens"]), _fmt(s["wall_s"], ".2f"), _fmt(s["tokens_per_s"], ".2f"),
                     _fmt(s.get("speedup_vs_vanilla"), ".2f"), _fmt(s["tau"], ".2f"),
                     _fmt(s["accepted_per_round"], ".2f"),
                     _fmt(s["draft_ms"], ".1f"), _fmt(s["verify_ms"], ".1f"), _fmt(s["other_ms"], ".1f"), match))
    _print_rows(rows, file)
    categories = list(next(iter(summary.values())).get("tau_by_category", {}))  # absent from older JSON reports
    if len(categories) > 1:
        print("\ntau by category", file=file)
        _print_rows([("method", *categories)] + [
            (method, *(_fmt(s["tau_by_category"][c], ".2f") for c in categories)) for method, s in summary.items()
        ], file)


def _print_rows(rows: list[tuple[str, ...]], file: TextIO | None) -> None:
    """Columns padded to their widest cell: the first left-aligned, numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))),
              file=file)


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        raise ValueError(f"--verify-curve takes comma-separated tree sizes such as 1,8,16; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"tree sizes must be at least 1; got {text!r}")
    return sizes


def print_curve(engine: Engine, sizes: list[int]) -> dict:
    """--verify-curve: the base model's verification cost by tree size (engine/costs.py)."""
    rows = verification_curve(engine.target, sizes)
    print("tree tokens  ms/forward  x one-token step")
    for row in rows:
        print(f"{row['tree_tokens']:>11}  {row['ms']:>10.1f}  {row['ratio']:>16.2f}")
    return {"verification_curve": rows}


def plot(summary: dict, out: str | Path, title: str) -> None:
    """Two bar panels, tokens/s and tau, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, label in zip(axes, ("tokens_per_s", "tau"), ("tokens / s", "τ (new tokens per base forward)")):
        values = [summary[m][key] or 0.0 for m in methods]
        bars = ax.bar(methods, values, color=[COLORS.get(m, "#9467bd") for m in methods])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the docstring's layout and show every option's default."""


def build_parser() -> argparse.ArgumentParser:
    defaults = DecodeParams()
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--questions", default=SHARED_QUESTIONS if SHARED_QUESTIONS.exists() else None,
                        required=not SHARED_QUESTIONS.exists(),
                        help="MT-bench JSON lines: question_id, category, turns")
    parser.add_argument("--limit", type=int, default=20, help="benchmark the first N questions")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per answer at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, set before every generation")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated list")
    parser.add_argument("--base", default=None,
                        help="base model: .gguf file, folder or hub id; unset = the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--head", default="default",
                        help="draft head folder or hub id; 'default' = the shipped head, 'none' = no head")
    parser.add_argument("--compare-head", action="append", default=[], metavar="NAME=HEAD",
                        help="also run the engine with this head, as method NAME (repeatable)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="dtype of the base model; auto: bfloat16 on a CPU with native bf16, else float32")
    parser.add_argument("--hf-dtype", choices=list(DTYPES), help="dtype for hf and hf-pld (default: the engine's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (every GPU)")
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="bitsandbytes weights")
    parser.add_argument("--tree", default=defaults.tree, choices=TREES, help="EAGLE-2 dynamic or EAGLE-1 static")
    parser.add_argument("--total-tokens", type=int, default=defaults.total_tokens, help="tree nodes incl. root")
    parser.add_argument("--depth", type=int, default=defaults.depth, help="tree expansion steps")
    parser.add_argument("--draft-top-k", type=int, default=defaults.draft_top_k, help="children per expanded node")
    parser.add_argument("--no-pack", dest="pack", action="store_false",
                        help="keep the engine's CPU linear layers as transformers has them (no oneDNN packing)")
    parser.add_argument("--verify-curve", default=None, metavar="SIZES",
                        help="instead of the methods: time one verification forward of each comma-separated tree "
                             "size (1 = a plain step) over a 300-token cache, and print the curve")
    parser.add_argument("--json", dest="json_out", default=None, help="write the full results here")
    parser.add_argument("--plot", default=None, help="write a bar chart (PNG) of tokens/s and tau here")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        methods = parse_methods(args.methods)
        compare_heads = parse_compare_heads(args.compare_head)
        if args.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {args.limit}")
        questions = load_questions(args.questions, args.limit)
        params = dict(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, tree=args.tree,
            total_tokens=args.total_tokens, depth=args.depth, draft_top_k=args.draft_top_k,
        )
        DecodeParams(**params)  # reject bad settings before loading a model
        curve_sizes = parse_sizes(args.verify_curve) if args.verify_curve else None
    except (ValueError, OSError) as err:
        parser.error(str(err))

    head = None if args.head.lower() == "none" else args.head
    try:
        engine = Engine.load(
            args.base, head, device=args.device, dtype=args.dtype, quantization=args.quantization, pack=args.pack
        )
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError; a missing base is FileNotFoundError
        parser.error(str(err))
    if curve_sizes:
        return print_curve(engine, curve_sizes)
    engines = {"vanilla": engine, "eagle": engine}
    for name, compare_head in compare_heads.items():
        try:
            engines[name] = engine.with_head(compare_head)
        except (ValueError, OSError) as err:
            parser.error(f"--compare-head {name}: {err}")
        methods.append(name)
    head_name = (str(DEFAULT_HEAD) if head == "default" else head) if engine.head else None
    if "eagle" in methods and engine.head is None:
        reason = "--head none" if head is None else f"the shipped head {DEFAULT_HEAD} is missing or not for this base"
        print(f"note: skipping method eagle: no draft head ({reason}); pass --head FOLDER", file=sys.stderr)
        methods.remove("eagle")
    if not methods:
        parser.error("no method left to run")
    prompts = []
    for q in questions:
        try:
            prompts.append(engine.encode_chat([{"role": "user", "content": q["turns"][0]}]))
            if len(prompts[-1]) >= engine.max_context:
                raise ValueError(f"{len(prompts[-1])} tokens, the context holds {engine.max_context}")
        except ValueError as err:
            parser.error(f"question {q['question_id']}: {err}")

    dtype = str(engine.model.dtype).removeprefix("torch.")
    hf_dtype = args.hf_dtype or dtype
    hf_methods = {"hf", "hf-pld"} & set(methods)
    hf_model = engine.model
    if hf_methods and (engine.packed_layers or hf_dtype != dtype):
        hf_model, _ = load_base(args.base, dtype=hf_dtype, device=args.device, quantization=args.quantization)
    warmup = {**params, "max_new_tokens": min(WARMUP_TOKENS, args.max_new_tokens)}
    for method in methods:
        run_method(engines, hf_model, method, prompts[0], warmup)
    runs: dict[str, list[Run]] = {m: [] for m in methods}
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="gen") as bar:
        for i, (q, prompt) in enumerate(zip(questions, prompts)):
            for method in methods[i % len(methods):] + methods[: i % len(methods)]:
                bar.set_postfix(question=q["question_id"], method=method)
                runs[method].append(run_method(engines, hf_model, method, prompt, params))
                bar.update()

    baseline = runs.get("vanilla")
    summary = {m: summarize(runs[m], baseline, [q["category"] for q in questions]) for m in methods}
    add_speedups(summary)
    date = datetime.now().astimezone().isoformat(sep=" ", timespec="minutes")
    report = {
        "config": {
            "base": args.base or "embedded SmolLM2-135M-Instruct", "head": head_name,
            "compare_heads": compare_heads, "dtype": dtype, "hf_dtype": hf_dtype if hf_methods else None,
            "device": args.device,
            "questions": str(args.questions), "count": len(questions),
            "methods": methods, "date": date, "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "packed": args.pack, **params,
        },
        "summary": summary,
        "questions": [
            {
                "question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(prompt),
                "results": {
                    m: {"token_ids": runs[m][i].token_ids, "wall_s": runs[m][i].wall_s,
                        "target_forwards": runs[m][i].target_forwards}
                    for m in methods
                },
            }
            for i, (q, prompt) in enumerate(zip(questions, prompts))
        ],
    }

    print_table(summary, len(questions))
    if hf_methods and hf_dtype != dtype:
        print(f"note: {' and '.join(sorted(hf_methods))} ran in {hf_dtype}, the engine in {dtype}")
    if args.temperature == 0:
        inexact = set() if hf_dtype == dtype == "float32" else hf_methods
        for line in exactness_warnings(summary, len(questions), inexact):
            print(line)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        head_label = Path(head_name).name if head_name else "no head"
        plot(summary, args.plot, f"{report['config']['base']} · {head_label} · {dtype} · {date}")
    return report


if __name__ == "__main__":
    main()
