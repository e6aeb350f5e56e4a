"""The q4 kernels' AVX-512 path against their 8-lane AVX2 path, alternated in one process (the machine's drift hits
both alike): single matmuls of the embedded model's shapes, then whole answers of the default engine.

    python -m scripts.avx512_ab [--questions N] [--reps R]

The two paths give the same bits (tests/test_quant.py); this measures what the wider one buys on this CPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from statistics import mean

import torch

from engine import DecodeParams, Engine
from engine.model import kernels
from engine.model.groups import quantize
from engine.model.quant import QuantLinear
from engine.tools.runs import SHARED_QUESTIONS, first_turn_prompts, load_questions

SHAPES = (("Q4_1", 1536, 576), ("Q4_1", 576, 576), ("Q8_0", 49152, 576))  # FFN, attention, LM head


def microseconds(layer: QuantLinear, x: torch.Tensor, calls: int = 200) -> float:
    for _ in range(20):
        layer(x)
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls * 1e6


def compare_matmuls(reps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for kind, out, inputs in SHAPES:
        layer = QuantLinear(quantize(torch.randn(out, inputs, generator=generator) * 0.05, kind), None)
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, inputs, generator=generator)
            best = {wide: min(_timed(wide, microseconds, layer, x) for _ in range(reps)) for wide in (False, True)}
            print(f"{kind} {out} x {inputs}, {rows} rows: AVX2 {best[False]:.1f} us, AVX-512 {best[True]:.1f} us")


def tokens_per_s(engine: Engine, prompts: list[list[int]], method: str) -> float:
    """Decoding rounds only, prefill left out, as the bench's per-round figures."""
    tokens = seconds = 0.0
    for ids in prompts:
        for step in engine.generate(ids, DecodeParams(method=method, max_new_tokens=128)):
            if step.kind != "prefill":
                tokens, seconds = tokens + len(step.tokens), seconds + step.wall_s
    return tokens / seconds


def compare_answers(questions: int, reps: int) -> None:
    engine = Engine.load()
    prompts = first_turn_prompts(engine, load_questions(SHARED_QUESTIONS, limit=questions))
    tokens_per_s(engine, prompts[:1], "vanilla")  # warm-up
    speeds: dict[tuple[bool, str], list[float]] = {}
    for _ in range(reps):
        for wide in (False, True):
            for method in ("vanilla", "eagle"):
                speeds.setdefault((wide, method), []).append(_timed(wide, tokens_per_s, engine, prompts, method))
    for (wide, method), values in speeds.items():
        print(f"{'AVX-512' if wide else 'AVX2'} {method}: {', '.join(f'{v:.1f}' for v in values)} tok/s, "
              f"mean {mean(values):.1f}")


def _timed(wide: bool, function, *args):
    torch.ops.eagle_cpu.set_wide(wide)
    try:
        return function(*args)
    finally:
        torch.ops.eagle_cpu.set_wide(True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.avx512_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4, help="MT-bench questions for the whole answers")
    parser.add_argument("--reps", type=int, default=3, help="alternations of the two paths")
    args = parser.parse_args()
    if not kernels.available():
        sys.exit(f"engine/model/kernels: {kernels.unavailable_reason()}")
    if not torch.ops.eagle_cpu.set_wide(True):
        sys.exit("this CPU has no AVX-512 (avx512f and avx512dq): the 8-lane path is the only one")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    compare_matmuls(args.reps)
    compare_answers(args.questions, args.reps)


if __name__ == "__main__":
    main()
