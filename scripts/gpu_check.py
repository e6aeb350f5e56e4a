"""One-shot check of the GPU path on any CUDA machine, in a few minutes:

  1. lossless: greedy EAGLE == greedy vanilla on tiny random models in fp32 (every head kind and tree), on
     bitsandbytes 8-bit / 4-bit tiny models, and the exact-match fraction of the embedded model in fp16 and bf16
     (half precision kernels pick their reduction order by batch size, so exactness there is measured, not assumed);
  2. the benchmark (vanilla, hf, eagle) of `python -m engine.bench` on the embedded model;
  3. the verification-cost curve: one base forward of T tree tokens over a 512-token cache on a random-weight
     Llama of 7B shape (bf16), as a ratio to one plain decoding step. Tree sizes whose ratio stays near 1 are
     nearly free to verify: that is where the GPU tree defaults (total_tokens) belong.

    python scripts/gpu_check.py --out gpu-check.json
    python scripts/gpu_check.py --out dry.json --cpu-dry-run   # the same code paths on the CPU, tiny sizes

Every section runs even if an earlier one fails; failures are recorded in the JSON and the table.
The tiny models and random heads come from tests/conftest.py (so this needs requirements-dev.txt).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine import Engine  # noqa: E402
from engine.tools import bench, costs  # noqa: E402
from engine.draft.checkpoint import DEFAULT_HEAD  # noqa: E402
from engine.models import load_model  # noqa: E402
from engine.target import Target  # noqa: E402

_threads = torch.get_num_threads()
import conftest  # noqa: E402  (it pins one CPU thread for the test suite; the check keeps the machine's setting)

torch.set_num_threads(_threads)


@dataclass
class Settings:
    device: str
    tiny_shapes: list[str]  # among tests/conftest.py SHAPES
    tiny_tokens: int  # new tokens per tiny-model comparison
    quantized: list[tuple[str, str]]  # (quantization, compute dtype) pairs for the bitsandbytes tiny models
    embedded_dtypes: list[str]
    embedded_prompts: int
    embedded_tokens: int
    bench_dtype: str
    bench_questions: int
    bench_tokens: int
    curve_shape: dict  # LlamaConfig sizes of the random model whose verification cost is measured
    curve_dtype: str
    cache_tokens: int
    tree_sizes: list[int]
    repeats: int


GPU = Settings(
    device="cuda:0", tiny_shapes=list(conftest.SHAPES), tiny_tokens=80,
    quantized=[("8bit", "float32"), ("4bit", "float32"), ("8bit", "float16"), ("4bit", "bfloat16")],
    embedded_dtypes=["float16", "bfloat16"], embedded_prompts=8, embedded_tokens=128,
    bench_dtype="bfloat16", bench_questions=10, bench_tokens=128,
    curve_shape=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    curve_dtype="bfloat16", cache_tokens=512, tree_sizes=[1, 8, 16, 32, 64, 96, 128], repeats=10,
)
CPU_DRY_RUN = Settings(
    device="cpu", tiny_shapes=list(conftest.SHAPES)[:1], tiny_tokens=24, quantized=[("8bit", "float32"), ("4bit", "float32")],
    embedded_dtypes=["float32"], embedded_prompts=1, embedded_tokens=8,
    bench_dtype="float32", bench_questions=1, bench_tokens=8,
    curve_shape=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    curve_dtype="float32", cache_tokens=64, tree_sizes=[1, 8, 16, 32, 64, 96, 128], repeats=2,
)


def guarded(case: str, run) -> dict:
    """One case's result, or its error: a failing case must not hide the others."""
    try:
        return {"case": case, **run()}
    except Exception as err:
        traceback.print_exc()
        return {"case": case, "error": f"{type(err).__name__}: {err}"}


def compare(engine: Engine, prompt: list[int], new_tokens: int, **params) -> dict:
    """Greedy vanilla vs greedy EAGLE on one prompt: exactness, length of the common prefix, drafts accepted."""
    vanilla = conftest.tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=new_tokens))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=new_tokens, **params))
    eagle = conftest.tokens_of(steps)
    prefix = next((i for i, (a, b) in enumerate(zip(vanilla, eagle)) if a != b), min(len(vanilla), len(eagle)))
    return {"exact": vanilla == eagle, "common_prefix": prefix, "tokens": len(vanilla),
            "accepted": sum(s.accepted for s in steps)}


def tiny_lossless(s: Settings) -> list[dict]:
    prompt = torch.randint(0, conftest.VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = []
    for shape in s.tiny_shapes:
        model = conftest.tiny_base(shape).to(s.device)
        for kind in ("eagle1", "eagle3"):
            engine = Engine(model, conftest.IdsOnlyTokenizer(), conftest.random_head(model, kind))
            for tree in ("dynamic", "static"):
                rows.append(guarded(f"{shape} {kind} {tree} float32",
                                    lambda: compare(engine, prompt, s.tiny_tokens, tree=tree)))
    return rows


def quantized_lossless(s: Settings) -> list[dict]:
    """bitsandbytes tiny models (default-scale weights: no activation crosses LLM.int8's outlier threshold)."""
    prompt = torch.randint(0, conftest.VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=conftest.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        for quantization, dtype in s.quantized:
            for kind in ("eagle1", "eagle3"):
                rows.append(guarded(f"llama-h64 {quantization} {kind} {dtype}",
                                    lambda: compare(quantized_engine(folder, quantization, dtype, kind, s.device),
                                                    prompt, s.tiny_tokens)))
    return rows


def quantized_engine(folder: str, quantization: str, dtype: str, kind: str, device: str) -> Engine:
    model = load_model(folder, quantization=quantization, dtype=dtype, device=device)
    model.generation_config.eos_token_id = None
    return Engine(model, conftest.IdsOnlyTokenizer(), conftest.random_head(model, kind))


def embedded_exactness(s: Settings) -> list[dict]:
    """The embedded model with its shipped head, on the first MT-bench prompts, per dtype."""
    if not DEFAULT_HEAD.exists():
        return [{"case": "embedded", "skipped": f"no shipped head at {DEFAULT_HEAD}"}]
    questions = bench.load_questions(bench.SHARED_QUESTIONS, s.embedded_prompts)
    rows = []
    for dtype in s.embedded_dtypes:
        engine = Engine.load(head=DEFAULT_HEAD, device=s.device, dtype=dtype)
        for q in questions:
            prompt = engine.encode_chat([{"role": "user", "content": q["turns"][0]}])
            rows.append(guarded(f"embedded {dtype} q{q['question_id']}",
                                lambda: compare(engine, prompt, s.embedded_tokens)))
    return rows


def run_bench(s: Settings, folder: Path) -> dict:
    out = folder / "bench.json"
    bench.main([
        "--device", s.device, "--dtype", s.bench_dtype, "--methods", "vanilla,hf,eagle",
        "--limit", str(s.bench_questions), "--max-new-tokens", str(s.bench_tokens), "--json", str(out),
    ])
    report = json.loads(out.read_text())
    return {"config": report["config"], "summary": report["summary"]}


def verification_curve(s: Settings) -> list[dict]:
    """The verification-cost curve (engine/costs.py) of a random-weight model of the configured shape."""
    config = LlamaConfig(**s.curve_shape)
    with torch.device(s.device):
        model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, s.curve_dtype)).eval().requires_grad_(False)
    rows = costs.verification_curve(Target(model), s.tree_sizes, s.cache_tokens, s.repeats)
    del model
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def suggested_total_tokens(curve: list[dict], ceiling: float) -> int | None:
    """The largest measured tree whose verification costs at most `ceiling` plain steps."""
    fitting = [row["tree_tokens"] for row in curve if row["ratio"] <= ceiling and row["tree_tokens"] > 1]
    return max(fitting) if fitting else None


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: installed(name) for name in ("transformers", "bitsandbytes", "flash-attn")}}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def print_table(results: dict, file=sys.stdout) -> None:
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(f"\nGPU check on {', '.join(results['environment'].get('gpus', ['cpu']))}  "
      f"(torch {results['environment']['torch']}, bitsandbytes {results['environment']['bitsandbytes']})")
    for name in ("tiny_lossless", "quantized_lossless", "embedded_exactness"):
        section = results[name]
        p(f"\n[{name}] {section['seconds']:.0f} s")
        if "error" in section:
            p(f"  FAILED: {section['error']}")
            continue
        rows = section["rows"]
        compared = [r for r in rows if "exact" in r]
        for r in rows:
            if "skipped" in r or "error" in r:
                p(f"  {r['case']:<44} {'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + r['error']}")
            else:
                p(f"  {r['case']:<44} {'exact' if r['exact'] else 'DIFFERS'}  prefix {r['common_prefix']:>4}/"
                  f"{r['tokens']:<4} accepted {r['accepted']}")
        if compared:
            p(f"  exact: {sum(r['exact'] for r in compared)}/{len(compared)}   common-prefix fraction: "
              f"{sum(r['common_prefix'] for r in compared) / max(1, sum(r['tokens'] for r in compared)):.3f}")
    section = results["bench"]
    p(f"\n[bench] {section['seconds']:.0f} s")
    if "error" in section:
        p(f"  FAILED: {section['error']}")
    else:
        bench.print_table(section["summary"], section["config"]["count"], file=file)
    section = results["verification_curve"]
    p(f"\n[verification_curve] {section['seconds']:.0f} s  ({section.get('shape', '')})")
    if "error" in section:
        p(f"  FAILED: {section['error']}")
    else:
        p("  tree tokens   ms/forward   x one plain step")
        for r in section["rows"]:
            p(f"  {r['tree_tokens']:>11}   {r['ms']:>10.2f}   {r['ratio']:>16.2f}")
        p(f"  largest tree within 1.25x: {section['within_1.25x']}, within 1.5x: {section['within_1.5x']}")
    p(f"\ntotal {results['seconds']:.0f} s")


def timed(function, *args) -> dict:
    """Run one section; record its result or its error, and how long it took."""
    start = time.perf_counter()
    try:
        result = function(*args)
        section = {"rows": result} if isinstance(result, list) else dict(result)
    except Exception as err:  # a failed section must not lose the others' results
        traceback.print_exc()
        section = {"error": f"{type(err).__name__}: {err}"}
    section["seconds"] = time.perf_counter() - start
    return section


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="write the results (JSON) here")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU, to test this script")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        parser.exit(2, f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, CUDA build: "
                       f"{torch.version.cuda or 'none'}); run it on a CUDA machine, or pass --cpu-dry-run\n")
    s = CPU_DRY_RUN if args.cpu_dry_run else GPU
    start = time.perf_counter()
    results = {"settings": asdict(s), "environment": environment()}
    results["tiny_lossless"] = timed(tiny_lossless, s)
    results["quantized_lossless"] = timed(quantized_lossless, s)
    results["embedded_exactness"] = timed(embedded_exactness, s)
    with tempfile.TemporaryDirectory() as folder:
        results["bench"] = timed(run_bench, s, Path(folder))
    curve = timed(verification_curve, s)
    curve["shape"] = (f"{s.curve_shape['num_hidden_layers']} layers, hidden {s.curve_shape['hidden_size']}, "
                      f"{s.curve_dtype}, cache {s.cache_tokens}")
    if "rows" in curve:
        curve["within_1.25x"] = suggested_total_tokens(curve["rows"], 1.25)
        curve["within_1.5x"] = suggested_total_tokens(curve["rows"], 1.5)
    results["verification_curve"] = curve
    results["seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    return results


if __name__ == "__main__":
    main()
