"""`python -m engine.bench`: decoding methods side by side on MT-bench style prompts: speed, acceptance and exactness.

Methods:
  vanilla  the engine without drafting, one base forward per token: the honest baseline
  eagle    the engine with its draft head (EAGLE trees, lossless verification), the context's continuations
           grafted on (--no-suffix: the head alone)
  suffix   the engine drafting from the context alone (what followed the longest earlier match of the text's end,
           engine/draft/context.py) and, where it has nothing, from the model's own replies to other prompts (--corpus,
           engine/draft/corpus.py): no head needed
  eagle-gated  eagle with the head gate (engine/decode/gate.py): the head drafts only in the rounds where measuring in the
           answer says it pays, the context alone in the others
  hf       transformers `generate` on the same model, as transformers runs it (stock layers, SDPA attention), in
           the engine's dtype (beside the q4 kernels: bfloat16 on a CPU with native bf16, transformers' faster
           dtype there, else float32) or --hf-dtype's
  hf-pld   transformers prompt lookup decoding (prompt_lookup_num_tokens=10)
  llama.cpp  (only when named in --methods) llama.cpp itself (xllamacpp, requirements-bench.txt) on the same GGUF file,
           the same prompt ids, greedy, with the engine's thread count: the runner a CPU user would pick. Its own
           decode-only tokens/s is printed under the table, beside vanilla's by the same measure (one over its mean
           step); its tokens are compared with vanilla's as a report (its kernels round differently)
  llama.cpp-eagle3  (only when named in --methods) llama.cpp's own EAGLE-3 speculative decoding with the draft head,
           exported once to llama.cpp's GGUF layout (engine/draft/export_gguf.py, cached), drafting
           --llamacpp-draft-max tokens a round: llama.cpp's acceptance (accepted / drafted tokens) is printed under
           the table, and its greedy tokens are held to plain llama.cpp's
  NAME     with --compare-head NAME=HEAD: the engine drafting with another head (say an EAGLE-1 head beside the
           shipped EAGLE-3 one), on the same base model in the same run

On the CPU the engine's linear layers are packed for oneDNN (engine/model/packed.py; --no-pack turns that off), so
hf and hf-pld get a second, unpacked copy of the model: they measure transformers itself.

Each question's first turn goes through the chat template (a model without one, or --no-chat-template, continues
it as plain text). Methods alternate question by question, in an order
that rotates per question, so a noisy machine slows them all alike; each method first runs one short untimed
warm-up generation.

tau = new tokens per decoding forward of the base model. The prefill forward and the token it produces are left
out, so tau = (tokens - 1) / (forwards - 1), summed over questions: plain decoding gives exactly 1.0, and a
speculative method's tau is its mean accepted length (accepted drafts + the base model's own token per round).
Per-round times (draft, verify, other) and rows/round (the tokens each verification forward scores, the root
included: 1 for a plain step) are means over decoding rounds, prefill excluded.

--json writes config, summary.<method> = {tokens, wall_s, tokens_per_s, tau, tau_by_category, rounds, draft_ms,
verify_ms, other_ms, accepted_per_round, rows_per_round, matches_vanilla, speedup_vs_vanilla} and questions[i] =
{question_id, category, prompt_tokens, results.<method> = {token_ids, wall_s, target_forwards}}. At temperature 0
every method must reproduce vanilla's tokens exactly; a WARNING line says which did not. hf methods are held to that
only in float32 and the engine's dtype: transformers' own kernels round bf16/fp16 differently from the engine's
(exact) ones.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from ..decode.costs import verification_curve
from ..decode.accept import Sampling
from ..decode.params import DYNAMIC_TREE_OPTIONS, DecodeParams
from ..decode.params import METHODS as ENGINE_METHODS
from ..draft.checkpoint import DEFAULT_HEAD
from ..draft.context import ContextDraft
from ..draft.tree import TREES, DynamicTree
from ..engine import Engine
from ..flags import add_flags, flag_values
from ..model.load import DTYPES, auto_dtype, gguf_file, load_base
from ..options import LoadOptions
from ..draft.export_gguf import cached_export
from ..model.gguf_cache import cache_root
from .llamacpp import EAGLE3_METHOD, Eagle3Draft, LlamaCpp, decode_tokens_per_s, eagle3_notes, eagle3_summary
from ..progress import progress_bar
from .report import add_speedups, exactness_warnings, plot, print_table, summarize
from .runs import SHARED_QUESTIONS, Run, first_turn_prompts, load_questions, run_engine, run_hf

GATED = "eagle-gated"
METHODS = (*ENGINE_METHODS, GATED, "hf", "hf-pld")
# other runners, from optional packages (requirements-bench.txt): only when asked for
PEERS = ("llama.cpp", EAGLE3_METHOD)
WARMUP_TOKENS = 8


@dataclass
class Setup:
    """What the command line asks for, checked before any model is loaded."""

    methods: list[str]
    compare_heads: dict[str, str]
    questions: list[dict]
    params: DecodeParams
    curve_sizes: list[int] | None
    curve_cache: list[int]  # cached tokens under each --verify-curve measurement


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS + PEERS]
    if unknown:
        raise ValueError(f"unknown method {', '.join(map(repr, unknown))}; choose among {', '.join(METHODS + PEERS)}")
    if not methods:
        raise ValueError(f"no method given; choose among {', '.join(METHODS + PEERS)}")
    return list(dict.fromkeys(methods))


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


def parse_sizes(text: str, flag: str = "--verify-curve", what: str = "tree sizes such as 1,8,16") -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {what}; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{flag}: every value must be at least 1; got {text!r}")
    return sizes


def decode_params(args: argparse.Namespace) -> DecodeParams:
    """The decoding settings of every engine method; the tree options are passed only when given."""
    shape = flag_values(DynamicTree, args)
    tree_options = {name: shape[key] for name, key in DYNAMIC_TREE_OPTIONS.items() if shape[key] is not None}
    return DecodeParams().with_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                       seed=args.seed, tree=args.tree, **tree_options,
                                       context=args.context and ContextDraft(sized=not args.fixed_chains))


def engine_options(method: str) -> dict:
    """The DecodeParams options of a method the engine runs: vanilla, eagle and suffix as named, eagle-gated eagle
    with the head gate, a --compare-head name eagle (with that engine's head)."""
    return {"method": method} if method in ENGINE_METHODS else {"method": "eagle", "gate": method == GATED}


def run_method(engines: dict[str, Engine], hf_model: PreTrainedModel, method: str, prompt: list[int],
               params: DecodeParams, llama: dict[str, LlamaCpp] | None = None) -> Run:
    """engines: the main engine under each engine method's name, and one per --compare-head name."""
    if method in engines:
        return run_engine(engines[method], prompt, params.with_options(**engine_options(method)))
    if method in PEERS:
        return llama[method].run(prompt, params)
    return run_hf(engines["vanilla"], hf_model, prompt, params, lookup=method == "hf-pld")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the docstring's layout and show every option's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__, formatter_class=_HelpFormatter)
    add = parser.add_argument
    add("--questions", default=SHARED_QUESTIONS if SHARED_QUESTIONS.exists() else None,
        required=not SHARED_QUESTIONS.exists(), help="MT-bench JSON lines: question_id, category, turns")
    add("--limit", type=int, default=20, help="benchmark the first N questions")
    add_flags(DecodeParams, parser, only=("max_new_tokens", "seed"))
    parser.set_defaults(max_new_tokens=128)
    add_flags(Sampling, parser, only=("temperature",))
    add("--methods", default=",".join(METHODS), help="comma-separated list")
    LoadOptions.add_arguments(parser, only=("base", "head", "dtype", "device", "quantization", "kernels", "corpus",
                                            "chat_template", "pack", "follow_load"))
    add("--compare-head", action="append", default=[], metavar="NAME=HEAD",
        help="also run the engine with this head, as method NAME (repeatable)")
    add("--llamacpp-draft-max", type=int, default=1, metavar="N",
        help=f"tokens {EAGLE3_METHOD} drafts a round (llama.cpp's speculative n_max)")
    add("--hf-dtype", choices=list(DTYPES),
        help="dtype for hf and hf-pld (default: the engine's; beside the q4 kernels, bfloat16 on a CPU with native "
             "bf16, else float32)")
    add("--tree", default="dynamic", choices=list(TREES), help="EAGLE-2 dynamic or EAGLE-1 static")
    add_flags(DynamicTree, parser)
    add("--no-suffix", dest="context", action="store_false",
        help="eagle drafts with the head alone, without the context's continuations")
    add("--fixed-chains", action="store_true",
        help="the context's chains at ContextDraft's own lengths, not cut to what their acceptance says pays")
    add("--verify-curve", default=None, metavar="SIZES",
        help="instead of the methods: time one verification forward of each comma-separated tree size (1 = a plain "
             "step) over a filled cache (--verify-cache), and print the curve")
    add("--verify-cache", default="300", metavar="TOKENS",
        help="with --verify-curve: comma-separated cache lengths to measure the curve over (default 300)")
    add("--busy", type=float, default=0, metavar="N",
        help="run N competing busy processes (a `while True` loop each) during the timed generations, to measure "
             "decoding on a loaded machine; a fractional part is one more process busy that share of the time, in "
             "bursts of a few ms (0.2: what a browser streaming the page takes)")
    add("--json", dest="json_out", default=None, help="write the full results here")
    add("--plot", default=None, help="write a bar chart (PNG) of tokens/s and tau here")
    return parser


def check_args(args: argparse.Namespace) -> Setup:
    if args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if args.busy < 0:
        raise ValueError(f"--busy is a number of cores to keep busy, at least 0, got {args.busy}")
    if not args.context and "suffix" in parse_methods(args.methods):
        raise ValueError("--no-suffix turns off the context drafting that method suffix is made of")
    for out in (args.json_out, args.plot):  # before minutes of decoding, not after
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    return Setup(
        methods=parse_methods(args.methods), compare_heads=parse_compare_heads(args.compare_head),
        questions=load_questions(args.questions, args.limit), params=decode_params(args),
        curve_sizes=parse_sizes(args.verify_curve) if args.verify_curve else None,
        curve_cache=parse_sizes(args.verify_cache, "--verify-cache", "cache lengths such as 300,1000,2000"),
    )


def load_engines(args: argparse.Namespace, setup: Setup) -> dict[str, Engine]:
    """The engine under each of ENGINE_METHODS and eagle-gated (those two only with a head), and one per
    --compare-head name; setup.methods loses them when there is no head and gains the compared heads' names."""
    # Every method prefills each prompt in full, the one after another's too.
    options = LoadOptions.from_args(args, reuse_prefixes=False)
    engine = Engine.from_options(options)
    engines = dict.fromkeys((*ENGINE_METHODS, GATED), engine)
    for name, compare_head in setup.compare_heads.items():
        try:
            engines[name] = engine.with_head(compare_head)
        except (ValueError, OSError) as err:
            raise ValueError(f"--compare-head {name}: {err}") from err
        setup.methods.append(name)
    for method in ("eagle", GATED):
        if method in setup.methods and engine.head is None:
            reason = ("--head none" if options.head is None
                      else f"the shipped head {DEFAULT_HEAD} is missing or not for this base")
            print(f"note: skipping method {method}: no draft head ({reason}); pass --head FOLDER", file=sys.stderr)
            setup.methods.remove(method)
    if not setup.methods:
        raise ValueError("no method left to run")
    return engines


def hf_model_for(args: argparse.Namespace, engine: Engine, methods: list[str]) -> PreTrainedModel:
    """transformers' own model for hf and hf-pld: a second, stock copy when the engine replaced layers of its own
    (packed or q4) or the hf methods run in another dtype."""
    hf_dtype = hf_dtype_for(args, engine)
    replaced = engine.packed_layers or engine.quantized_layers
    if {"hf", "hf-pld"} & set(methods) and (replaced or hf_dtype != _dtype_name(engine)):
        return load_base(args.base, dtype=hf_dtype, device=args.device, quantization=args.quantization)[0]
    return engine.model


def llama_cpp_for(args: argparse.Namespace, engine: Engine, methods: list[str],
                  prompts: list[list[int]]) -> dict[str, LlamaCpp]:
    """A llama.cpp server on the base model's GGUF file for each llama.cpp method that runs, with the engine's
    thread count."""
    peers = [method for method in PEERS if method in methods]
    if not peers:
        return {}
    path = gguf_file(args.base)
    if path is None:
        raise ValueError(f"method {peers[0]} runs a GGUF file: pass --base FILE.gguf, or leave --base unset for the "
                         "embedded model")
    context = max(map(len, prompts)) + args.max_new_tokens
    servers: dict[str, LlamaCpp] = {}
    try:
        for method in peers:
            draft = eagle3_draft_for(args, engine, path) if method == EAGLE3_METHOD else None
            servers[method] = LlamaCpp(path, threads=torch.get_num_threads(), context=context,
                                       stop_ids=engine.stop_ids, draft=draft)
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers


def eagle3_draft_for(args: argparse.Namespace, engine: Engine, target: Path) -> Eagle3Draft:
    """The engine's head as llama.cpp's EAGLE-3 draft: exported at the first run, then taken from the cache."""
    if engine.head is None or engine.head.kind != "eagle3":
        raise ValueError(f"method {EAGLE3_METHOD} needs an EAGLE-3 head: pass --head FOLDER")
    if args.llamacpp_draft_max < 1:
        raise ValueError(f"--llamacpp-draft-max must be at least 1, got {args.llamacpp_draft_max}")
    head = DEFAULT_HEAD if args.head == "default" else args.head
    return Eagle3Draft(cached_export(head, target, cache_root()), n_max=args.llamacpp_draft_max)


def hf_dtype_for(args: argparse.Namespace, engine: Engine) -> str:
    """--hf-dtype, else the engine's dtype, except beside the grouped kernels (float32 for their sake, not the CPU's):
    there transformers runs in the dtype the float path would take, bfloat16 where the CPU has it (its faster one)."""
    if args.hf_dtype:
        return args.hf_dtype
    return auto_dtype(args.device, args.quantization) if engine.kernels.grouped else _dtype_name(engine)


def _dtype_name(engine: Engine) -> str:
    return str(engine.model.dtype).removeprefix("torch.")


def run_all(engines: dict[str, Engine], hf_model: PreTrainedModel, setup: Setup,
            prompts: list[list[int]], llama: dict[str, LlamaCpp] | None = None) -> dict[str, list[Run]]:
    """Every method on every prompt, after one short warm-up each; the order rotates per question."""
    methods, params = setup.methods, setup.params
    warmup = params.with_options(max_new_tokens=min(WARMUP_TOKENS, params.max_new_tokens))
    for method in methods:
        run_method(engines, hf_model, method, prompts[0], warmup, llama)
    runs: dict[str, list[Run]] = {m: [] for m in methods}
    with progress_bar(total=len(prompts) * len(methods), desc="bench", unit="gen") as bar:
        for i, (q, prompt) in enumerate(zip(setup.questions, prompts)):
            for method in methods[i % len(methods):] + methods[: i % len(methods)]:
                bar.set_postfix(question=q["question_id"], method=method, refresh=False)
                runs[method].append(run_method(engines, hf_model, method, prompt, params, llama))
                bar.update()
    return runs


def build_report(args: argparse.Namespace, setup: Setup, engine: Engine, prompts: list[list[int]],
                 runs: dict[str, list[Run]]) -> dict:
    methods, params = setup.methods, setup.params
    summary = {m: summarize(runs[m], runs.get("vanilla"), [q["category"] for q in setup.questions]) for m in methods}
    add_speedups(summary)
    if "llama.cpp" in summary:
        summary["llama.cpp"]["decode_tokens_per_s"] = decode_tokens_per_s(runs["llama.cpp"])
    if EAGLE3_METHOD in summary:
        summary[EAGLE3_METHOD].update(eagle3_summary(runs[EAGLE3_METHOD], runs.get("llama.cpp"),
                                                     args.llamacpp_draft_max))
    hf_methods = {"hf", "hf-pld"} & set(methods)
    config = {
        "base": args.base or "embedded SmolLM2-135M-Instruct",
        "head": (str(DEFAULT_HEAD) if args.head == "default" else args.head) if engine.head else None,
        "compare_heads": setup.compare_heads, "dtype": _dtype_name(engine), "kernels": engine.kernels,
        "hf_dtype": hf_dtype_for(args, engine) if hf_methods else None, "device": args.device,
        "questions": str(args.questions), "count": len(setup.questions), "methods": methods,
        "date": datetime.now().astimezone().isoformat(sep=" ", timespec="minutes"), "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(), "packed": args.pack,
        "max_new_tokens": params.max_new_tokens, "temperature": params.sampling.temperature, "seed": params.seed,
        "tree": {"kind": type(params.tree).__name__, **asdict(params.tree)},
        "context": asdict(params.context) if params.context else None, "busy_cores": args.busy,
        "follow_load": args.follow_load,
    }
    questions = [
        {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(prompt),
         "results": {m: {"token_ids": runs[m][i].token_ids, "wall_s": runs[m][i].wall_s,
                         "target_forwards": runs[m][i].target_forwards} for m in methods}}
        for i, (q, prompt) in enumerate(zip(setup.questions, prompts))
    ]
    return {"config": config, "summary": summary, "questions": questions}


def print_report(report: dict) -> None:
    """The table, then which dtypes ran and, at temperature 0, which methods failed to reproduce vanilla."""
    config, summary = report["config"], report["summary"]
    print_table(summary, config["count"])
    hf_methods = {"hf", "hf-pld"} & set(config["methods"])
    if hf_methods and config["hf_dtype"] != config["dtype"]:
        print(f"note: {' and '.join(sorted(hf_methods))} ran in {config['hf_dtype']}, the engine in {config['dtype']}")
    if "llama.cpp" in summary:
        peer = summary["llama.cpp"]
        step = summary.get("vanilla", {}).get("verify_ms")
        ours = f"; vanilla decodes at {1000 / step:.2f} tok/s by the same measure (one over its mean step)" \
            if step else ""
        print(f"note: llama.cpp decodes at {peer['decode_tokens_per_s']:.2f} tok/s by its own clock (prefill "
              f"excluded){ours}; its greedy tokens equal vanilla's on {peer['matches_vanilla']}/{config['count']} "
              "questions (its kernels round differently: a report, not a check)")
    if EAGLE3_METHOD in summary:
        print("\n".join(eagle3_notes(summary[EAGLE3_METHOD], config["count"])))
    if config["temperature"] == 0:
        for line in exactness_warnings(summary, config["count"], exactness_exempt(config)):
            print(line)


def exactness_exempt(config: dict) -> set[str]:
    """Methods that run another model than the engine: llama.cpp always; hf unless both run float32 weights
    (beside the grouped kernels, or in bfloat16, transformers computes other numbers, so other tokens are expected)."""
    hf_methods = {"hf", "hf-pld"} & set(config["methods"])
    same_model = config["hf_dtype"] == config["dtype"] == "float32" and config.get("kernels", "float") == "float"
    return (set() if same_model else hf_methods) | {"llama.cpp"} | (set(PEERS) & set(config["methods"]))


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        setup = check_args(args)
        engines = load_engines(args, setup)  # CheckpointError is a ValueError; a missing base is FileNotFoundError
        engine = engines["vanilla"]
        if setup.curve_sizes:
            return print_curve(engine, setup.curve_sizes, setup.curve_cache)
        prompts = first_turn_prompts(engine, setup.questions)
        llama = llama_cpp_for(args, engine, setup.methods, prompts)
    except (ValueError, OSError, ImportError) as err:
        parser.error(str(err))
    hf_model = hf_model_for(args, engine, setup.methods)
    try:
        with busy_processes(args.busy) as busy:
            runs = run_all(engines, hf_model, setup, prompts, llama)
    finally:
        for server in llama.values():
            server.close()
    report = build_report(args, setup, engine, prompts, runs)
    report["config"]["busy_cores_measured"] = busy.measured
    print_report(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        head = Path(report["config"]["head"]).name if report["config"]["head"] else "no head"
        plot(report["summary"], args.plot, f"{report['config']['base']} · {head} · {report['config']['dtype']} · "
                                           f"{report['config']['date']}")
    return report


BURST_S = 0.004  # a partly busy process's bursts: about one frame's rendering work of a browser
# The program of a partly busy process (`python -c BUSY_LOOP SHARE`): bursts of work of BURST_S, each followed by the
# rest that makes the work SHARE of the time. `loop` takes its clock and its sleep as arguments so that its schedule
# can be checked without timing anything.
BUSY_LOOP = """import sys, time


def loop(share, burst, clock=time.perf_counter, sleep=time.sleep):
    rest = burst * (1 - share) / share
    while True:
        end = clock() + burst
        while clock() < end:
            pass
        sleep(rest)


if __name__ == "__main__":
    loop(float(sys.argv[1]), {burst})
""".format(burst=BURST_S)


@dataclass
class BusyLoad:
    """The busy processes of one block: the cores asked for, each process's share of a core, and once the block is
    over `measured`, the cores they used on average (None without processes, or where the OS cannot say)."""

    asked: float
    shares: list[float]
    processes: list[subprocess.Popen]
    measured: float | None = None

    def line(self) -> str:
        used = "not measured" if self.measured is None else f"measured {self.measured:.2f}"
        return f"busy load: asked {self.asked:.2f} cores, {used}"


def _cpu_s_at_exit(process: subprocess.Popen) -> float | None:
    """Reap a killed process; returns the CPU seconds it used in all, as the kernel accounted them at its exit."""
    if not hasattr(os, "wait4"):
        process.wait()
        return None
    try:
        _, status, usage = os.wait4(process.pid, 0)
    except ChildProcessError:  # reaped already
        process.wait()
        return None
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def busy_processes(load: float):
    """Processes at the default nice level that keep `load` cores busy while the block runs: one `while True` loop
    per whole core, and for a fractional part one that is busy that share of the time, in bursts of BURST_S.

    Yields a BusyLoad. When the block ends the processes are killed, and the cores they used (their CPU time over
    the block's wall time) are stored in its `measured` and printed as a line: on a machine with other work they may
    get less than asked, which is for the benchmark's reader to see, not for the load to correct."""
    whole, part = divmod(load, 1)
    shares = [1.0] * int(whole) + ([part] if part > 1e-3 else [])
    started = time.perf_counter()
    busy = BusyLoad(load, shares, [subprocess.Popen([sys.executable, "-c", "while True: pass"] if share == 1 else
                                                    [sys.executable, "-c", BUSY_LOOP, str(share)]) for share in shares])
    try:
        yield busy
    finally:
        wall = time.perf_counter() - started
        for process in busy.processes:
            process.kill()
        used = [_cpu_s_at_exit(process) for process in busy.processes]
        if used and None not in used:
            busy.measured = sum(used) / wall
        if used:
            print(busy.line())


def print_curve(engine: Engine, sizes: list[int], cache_lengths: list[int]) -> dict:
    """--verify-curve: the base model's verification cost by tree size over each cache length (engine/decode/costs.py);
    a long chat makes every forward attend to more keys, a tree's many rows more so."""
    if max(cache_lengths) + max(sizes) > engine.max_context:
        raise ValueError(f"--verify-cache {max(cache_lengths)} + a tree of {max(sizes)} exceeds the model's context "
                         f"of {engine.max_context} tokens")
    print("cached tokens  tree tokens  ms/forward  x one-token step")
    rows = []
    for cached in cache_lengths:
        for row in verification_curve(engine.target, sizes, cache_tokens=cached):
            rows.append({"cache_tokens": cached, **row})
            print(f"{cached:>13}  {row['tree_tokens']:>11}  {row['ms']:>10.1f}  {row['ratio']:>16.2f}")
    return {"verification_curve": rows}


if __name__ == "__main__":
    main()
