"""A new EAGLE-3 head for the embedded model in one short run on a GPU: regenerate ShareGPT replies, train, bring
head and replies back.

The device machine takes 64 MiB a call (this checkout included) and returns 8 files of at most 16 MiB each; the
embedded GGUF, the ShareGPT file and the head are each larger than one such file. So the work is split:

  pack    (here)   choose and tokenize the prompts, cut the GGUF into parts, plan which call carries which
                   files (runs/gpu/plan.json, with the commands)
  run     (there)  join the GGUF (checked against its SHA-256), regenerate replies greedily until the data share of
                   the time is spent, fit a new EAGLE-3 head on them and the committed data with features on the fly,
                   write the head and the records in returnable pieces
  unpack  (here)   join the head (checked against its SHA-256) and the records into one file (engine.draft.records)

    python -m scripts.gpu_train pack
    python -m scripts.gpu_train run --parts runs/gpu /tmp/carry --out $OUT --minutes 9     # on the GPU
    python -m scripts.gpu_train unpack --files FILES_AT --out runs/head-gpu
    python -m scripts.gpu_train smoke       # all three on this CPU with tiny settings (a few minutes)

Replies come from the GGUF's dequantized float32 weights in transformers' forward, while the engine on the CPU
decodes the same groups with int8 activations: their greedy tokens agree at most reply positions, so the data is the
engine's model's text with an occasional divergence.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path

import torch

from engine.draft.records import load_records, save_records
from engine.model.gguf_cache import sha256
from engine.model.load import embedded_gguf_path, load_model, load_tokenizer
from engine.train.data import read_conversations, select_prompts, stop_ids
from engine.train.fit import FitConfig
from engine.train.generation import GROUPED_ATTENTION, BatchGenerator
from engine.train.pipeline import fit_head

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.gpu_train"

MIB = 2**20
CALL_MIB = 64  # what one device call takes, this checkout included
RETURN_MIB = 15  # under the 16 MiB a returned file may hold
# The committed self-distilled records: left out of the prompts, trained on beside the new replies; the first file's
# every 40th record is the validation set.
COMMITTED = tuple(ROOT / "data" / "selfdistill" / name for name in (
    "smollm2-int8-2000.npz", "smollm2-int8-turns.npz", "smollm2-int8-turns-2.npz", "smollm2-int8-turns-3.npz"))
BASE_NAME = "base.gguf"
PROMPTS = "prompts.npz"
MANIFEST = "manifest.json"
WHEELS = "wheels"  # gguf, which transformers reads the base with; the GPU machine's image lacks it
STAGING = "/tmp/carry"  # where the calls before the last leave their parts, on the machine while it stays warm


@dataclass(frozen=True)
class Budget:
    """How the run spends its minutes and its GPU: generation until `data_share` of the time, then the fit."""

    minutes: float = 9.0
    data_share: float = 0.45
    max_new_tokens: int = 256
    slots: int = 2048  # rows decoded together, at most (the cache holds slots x (longest prompt + max_new_tokens);
    # fewer where they would leave under a quarter of the GPU's memory free)
    chunk: int = 16384  # prompts per generator: each is sorted by length, so a cut in time keeps long prompts too
    prefill_tokens: int = 65536
    draft_vocab_size: int = 8192  # the shipped head's: its MT-bench τ kept at 8,192 (docs/training.md)
    ttt_steps: int = 5
    batch_tokens: int = 32768
    lr: float = 1e-3
    epochs: float = 20.0  # an upper bound: the time left sets the schedule's length
    warmup: int = 20
    closing_s: float = 30.0  # kept for the final validation, saving the head and cutting it into pieces
    val_every: int = 40  # every n-th record of the first committed file is held out: the validation set CPU fits use


SMOKE_PROMPTS = 12
SMOKE = Budget(minutes=0.75, data_share=0.7, max_new_tokens=12, slots=6, chunk=8, prefill_tokens=512,
               draft_vocab_size=2048, ttt_steps=2, batch_tokens=768, epochs=1.0, warmup=2, closing_s=15.0,
               val_every=400)


def split_file(path: Path, folder: Path, part_bytes: int, stem: str) -> list[str]:
    """Cut `path` into files `stem`.00, .01, ... of at most `part_bytes` in `folder`; returns their names."""
    names = []
    with path.open("rb") as f:
        while block := f.read(part_bytes):
            names.append(f"{stem}.{len(names):02d}")
            (folder / names[-1]).write_bytes(block)
    return names


def find_part(name: str, folders: list[Path]) -> Path:
    """The packed file `name` in the first folder that has it (the calls of a plan leave files in several)."""
    found = next((f / name for f in folders if (f / name).is_file()), None)
    if found is None:
        raise FileNotFoundError(f"part {name} is in none of {', '.join(map(str, folders))}: was every "
                                "call of the plan made while the machine stayed warm?")
    return found


def join_parts(names: list[str], folders: list[Path], target: Path) -> Path:
    """Concatenate the named parts, each taken from the first folder that has it."""
    with target.open("wb") as out:
        for name in names:
            out.write(find_part(name, folders).read_bytes())
    return target


def tree_bytes() -> int:
    """What a device call sends besides the carried paths: tracked and untracked, not ignored, files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())


def carried_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def plan_calls(paths: list[Path], room: int) -> list[list[Path]]:
    """Files and folders grouped into calls, in order, each call's within `room` bytes and 8 carried paths."""
    calls, size = [[]], 0
    for path in paths:
        if calls[-1] and (size + carried_bytes(path) > room or len(calls[-1]) == 8):
            calls.append([])
            size = 0
        calls[-1].append(path)
        size += carried_bytes(path)
    return calls


def shown(path: Path) -> str:
    """A path as a call names it: relative to the checkout, the device's working directory."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def pack(out: Path, base: Path, limit: int | None, max_prompt_tokens: int, part_mib: float | None,
         wheels: bool = True) -> dict:
    """Prompts and the base model in carryable parts, and the plan of calls (written to out/plan.json)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer = load_tokenizer(str(base))
    have = {r["id"] for path in COMMITTED for r in load_records(path)}
    wanted = None if limit is None else limit + len(have)
    chosen = select_prompts(read_conversations(), tokenizer, wanted, max_prompt_tokens, turns="all")
    prompts = [{"id": ident, "input_ids": ids, "prompt_len": len(ids)} for ident, _, ids, _ in chosen
               if ident not in have][:limit]
    save_records(prompts, out / PROMPTS, {"command": f"{COMMAND} pack", "turns": "all",
                                          "max_prompt_tokens": max_prompt_tokens})
    room = CALL_MIB * MIB - tree_bytes() - MIB // 2
    part = int(part_mib * MIB) if part_mib else room
    if part <= 0 or part > room:
        raise ValueError(f"a call has {room / MIB:.1f} MiB beside this checkout; parts of {part / MIB:.1f} MiB "
                         "do not fit (move large tracked files that the run does not need out of the tree first)")
    parts = split_file(base, out, part, BASE_NAME)
    manifest = {"base_parts": parts, "base_sha256": sha256(base), "base_bytes": base.stat().st_size,
                "stops": stop_ids(tokenizer), "prompts": len(prompts)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    files = [out / name for name in parts] + [out / PROMPTS, out / MANIFEST]
    if wheels:
        files.append(fetch_wheels(out / WHEELS))
    calls = plan_calls(files, room)
    plan = {"room_mib": round(room / MIB, 1), **manifest,
            "calls": [{"carry": [shown(f) for f in call], "command": call_command(call, i + 1 == len(calls))}
                      for i, call in enumerate(calls)]}
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    return plan


def fetch_wheels(folder: Path) -> Path:
    """The wheel of this machine's gguf, for the GPU machine (pure Python: one wheel serves every platform)."""
    folder.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(folder), f"gguf=={version('gguf')}"], check=True)
    return folder


def call_command(carried: list[Path], last: bool) -> str:
    """The shell command of one device call: stage its parts, or (the last) install gguf and run."""
    if not last:
        return f"mkdir -p {STAGING} && cp {' '.join(shown(f) for f in carried)} {STAGING}/"
    folder = shown(carried[-1].parent)
    return (f"python3 -m pip install -q --no-index --no-deps --target /tmp/site {folder}/{WHEELS}/*.whl && "
            f"export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && set -o pipefail && python3 -m scripts.gpu_train run "
            f"--parts {folder} {STAGING} --out $OUT --minutes {Budget.minutes:g} 2>&1 | tee $OUT/log")


def regenerate(model, prompts: list[dict], stops: list[int], budget: Budget, deadline: float) -> list[dict]:
    """Greedy replies to `prompts`, `budget.chunk` at a time, until `deadline`: full records (prompt + reply)."""
    records, tokens, started, shown = [], 0, time.time(), time.time()
    for start in range(0, len(prompts), budget.chunk):
        chunk = prompts[start:start + budget.chunk]
        generator = BatchGenerator(model, [p["input_ids"] for p in chunk], stops, budget.max_new_tokens,
                                   budget.slots, prefill_tokens=budget.prefill_tokens, refill=budget.slots // 8)
        print(f"  prompts {start}-{start + len(chunk)}: {len(generator.owner)} slots of {generator.cache.capacity} "
              "tokens", flush=True)
        for index, reply in generator:
            if reply:
                prompt = chunk[index]
                records.append({"id": prompt["id"], "input_ids": prompt["input_ids"] + reply,
                                "prompt_len": prompt["prompt_len"]})
                tokens += len(reply)
            if time.time() - shown > 15:
                shown = time.time()
                print(f"  {len(records)} replies, {tokens} tokens, {tokens / (shown - started):.0f} reply tok/s",
                      flush=True)
            if time.time() > deadline:
                return records
        del generator  # its cache (most of the GPU) goes before the next chunk's is allocated
    return records


def save_pieces(records: list[dict], out: Path, stem: str, meta: dict) -> list[str]:
    """Records in as few record files as keep each under RETURN_MIB, every count-th record to a file."""
    count = 1
    while True:
        names = [f"{stem}-{i}.npz" for i in range(count)]
        for i, name in enumerate(names):
            save_records(records[i::count], out / name, meta)
        largest = max((out / name).stat().st_size for name in names)
        if largest <= RETURN_MIB * MIB:
            return names
        for name in names:
            (out / name).unlink()
        count = math.ceil(count * largest / (0.9 * RETURN_MIB * MIB))


def run(parts: list[Path], out: Path, budget: Budget, device: str, work: Path) -> dict:
    """On the GPU: the base from its parts, replies until the data deadline, the fit until the end, pieces out."""
    started = time.time()
    end = started + budget.minutes * 60
    manifest = json.loads(find_part(MANIFEST, parts).read_text())
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    base = join_parts(manifest["base_parts"], parts, work / BASE_NAME)
    if base.stat().st_size != manifest["base_bytes"] or sha256(base) != manifest["base_sha256"]:
        raise ValueError(f"{base} joined from its parts is not the packed GGUF (size or SHA-256 differs): a part "
                         "is missing, stale or damaged; pack again and carry every part")
    prompts = load_records(find_part(PROMPTS, parts))
    model = load_model(str(base), dtype="float32", device=device)
    model.set_attn_implementation(GROUPED_ATTENTION)
    print(f"base loaded in {time.time() - started:.0f}s; {len(prompts)} prompts", flush=True)

    generation_started = time.time()
    records = regenerate(model, prompts, manifest["stops"], budget, started + budget.minutes * 60 * budget.data_share)
    generation_s = time.time() - generation_started
    reply_tokens = sum(len(r["input_ids"]) - r["prompt_len"] for r in records)
    meta = {"command": f"{COMMAND} run", "device": torch.cuda.get_device_name() if
            torch.cuda.is_available() else "cpu", "dtype": "float32", "max_new_tokens": budget.max_new_tokens}
    data_files = save_pieces(records, out, "data", meta)  # returned, and what the fit reads
    print(f"{len(records)} replies, {reply_tokens} tokens in {generation_s:.0f}s "
          f"({reply_tokens / max(generation_s, 1e-9):.0f} reply tok/s)", flush=True)

    model.set_attn_implementation("sdpa")  # whole sequences, a padding mask: SDPA's own kernels
    torch.backends.cuda.matmul.allow_tf32 = True  # features for training: TF32 is close enough, and faster
    config = FitConfig(ttt_steps=budget.ttt_steps, lr=budget.lr, warmup=budget.warmup, epochs=budget.epochs,
                       batch_tokens=budget.batch_tokens, save_every=0, eval_every=0)
    head = work / "head"
    fit_s = end - time.time() - budget.closing_s
    data = [*COMMITTED, *(out / name for name in data_files)]
    summary = fit_head(model, data, head, work / "fit", "eagle3", budget.draft_vocab_size, config, cache=False,
                       val_every=budget.val_every, time_limit_s=max(fit_s, 1.0))
    head_files = split_file(head / "model.safetensors", out, RETURN_MIB * MIB, "head.safetensors")
    shutil.copy(head / "config.json", out / "head-config.json")
    report = {"budget": asdict(budget), "replies": len(records), "reply_tokens": reply_tokens,
              "generation_s": round(generation_s, 1), "data_files": data_files, "head_files": head_files,
              "head_sha256": sha256(head / "model.safetensors"), "seconds": round(time.time() - started, 1),
              "fit": summary}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def unpack(files: Path, head_out: Path, data_out: Path | None) -> dict:
    """Here: the head joined from its pieces (checked), and the run's records as one record file."""
    report = json.loads((files / "report.json").read_text())
    head_out.mkdir(parents=True, exist_ok=True)
    weights = join_parts(report["head_files"], [files], head_out / "model.safetensors")
    if sha256(weights) != report["head_sha256"]:
        raise ValueError(f"{weights} joined from {files} is not the head the run wrote (SHA-256 differs)")
    shutil.copy(files / "head-config.json", head_out / "config.json")
    if data_out is not None:
        records = [r for name in report["data_files"] for r in load_records(files / name)]
        save_records(records, data_out, {"command": f"{COMMAND} run, then unpack",
                                         "reply_tokens_per_s": report["reply_tokens"] / report["generation_s"]})
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="prompts and the base in carryable parts, and the plan of calls")
    packing.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu")
    packing.add_argument("--base", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2)")
    packing.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    packing.add_argument("--max-prompt-tokens", type=int, default=512)
    packing.add_argument("--part-mib", type=float, default=None, help="GGUF part size (default: what a call holds)")
    running = commands.add_parser("run", help="on the GPU: regenerate, fit, write returnable pieces")
    running.add_argument("--parts", type=Path, nargs="+", required=True, help="folders holding the packed files")
    running.add_argument("--out", type=Path, required=True)
    running.add_argument("--work", type=Path, default=Path("/tmp/train-gpu"))
    running.add_argument("--minutes", type=float, default=None, help=f"the whole run (default {Budget.minutes})")
    running.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    running.add_argument("--smoke", action="store_true", help="tiny settings (a CPU run of the same code)")
    unpacking = commands.add_parser("unpack", help="here: join the head and the data the run returned")
    unpacking.add_argument("--files", type=Path, required=True, help="the folder the run's files came back to")
    unpacking.add_argument("--out", type=Path, required=True, help="head folder")
    unpacking.add_argument("--data", type=Path, default=None, help="record file for prompts + replies (.npz)")
    smoke = commands.add_parser("smoke", help="pack, run and unpack on this CPU with tiny settings")
    smoke.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-smoke")
    args = parser.parse_args(argv)
    base = (getattr(args, "base", None) or embedded_gguf_path())
    if args.command == "pack":
        print(json.dumps(pack(args.out, base, args.limit, args.max_prompt_tokens, args.part_mib), indent=2))
    elif args.command == "run":
        budget = SMOKE if args.smoke else Budget()
        report = run(args.parts, args.out, replace(budget, minutes=args.minutes or budget.minutes), args.device,
                     args.work)
        print(json.dumps({k: v for k, v in report.items() if k != "fit"}, indent=2))
        print(json.dumps(report["fit"].get("validation"), indent=2))
    elif args.command == "unpack":
        report = unpack(args.files, args.out, args.data)
        print(f"head in {args.out}" + (f", {report['replies']} records in {args.data}" if args.data else ""))
    else:
        packed, returned = args.out / "pack", args.out / "returned"
        pack(packed, base, SMOKE_PROMPTS, 256, 16, wheels=False)
        run([packed], returned, SMOKE, "cpu", args.out / "work")
        unpack(returned, args.out / "head", args.out / "data.npz")
        print(f"smoke run done: head in {args.out / 'head'}, data in {args.out / 'data.npz'}")


if __name__ == "__main__":
    main()
