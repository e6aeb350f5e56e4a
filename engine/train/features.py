"""Target-model features for training, computed once per conversation and cached in safetensors chunks.

Per token we keep what the losses need and nothing more:
- `features`: what the head reads (EAGLE-3: inputs of the three fused layers, [T, 3H]; EAGLE-1: the final-norm
  hidden state, [T, H], stored once as `last`),
- `last`: the final-norm hidden state, from which the target's distribution is one matmul away,
- `top1`: the target's greedy next token (over the full vocabulary), for acceptance estimates.
Chunks are written whole, so an interrupted run resumes at the first missing chunk. `LiveFeatures` gives the same
batches computed on the fly, for when disk is short.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..draft.eagle3 import fused_layers
from ..model.cache import GrowingCache
from ..model.quant import kv_dtype
from ..model.target import Target
from ..progress import progress_bar

CHUNK = 64  # conversations per cache file


def feature_layers(kind: str, num_layers: int) -> list[int] | None:
    """Decoder layers whose inputs an EAGLE-3 head fuses; None for EAGLE-1 (final-norm hidden state)."""
    return fused_layers(num_layers) if kind == "eagle3" else None


def pad_batch(records: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded token ids, the non-padding mask, and the loss mask (reply tokens)."""
    width = max(len(r["input_ids"]) for r in records)
    ids = torch.zeros(len(records), width, dtype=torch.long)
    valid = torch.zeros(len(records), width, dtype=torch.bool)
    reply = torch.zeros_like(valid)
    for row, record in enumerate(records):
        n = len(record["input_ids"])
        ids[row, :n] = torch.tensor(record["input_ids"])
        valid[row, :n] = True
        reply[row, record["prompt_len"]:n] = True
    return {"input_ids": ids, "valid": valid, "reply": reply}


@torch.no_grad()  # not inference_mode: live features feed the head's autograd graph (a float32 fit uses them as is)
def target_features(target: Target, input_ids: torch.Tensor, valid: torch.Tensor, layers: list[int] | None,
                    with_top1: bool = True):
    """(features or None, final-norm hidden, greedy next token or None), each [B, T, ...], from `target`, the engine's
    runner (engine.model.target.Target) over the base model.

    Where the engine decodes with the fused decoder (a GGUF on the CPU's grouped kernels), each row is one forward of
    the engine's own runner over its tokens: the head learns from the very features the engine hands it while
    decoding. Elsewhere (a GPU, the float path) one padded forward of the same model and cache serves the batch."""
    if target.fused is None:
        return padded_forward(target.model, input_ids, valid, layers, with_top1)
    if target.feature_layers != layers:
        target.set_feature_layers(layers)
    rows = [target.forward(ids[keep], target.new_cache()) for ids, keep in zip(input_ids, valid)]
    width = input_ids.shape[1]

    def padded(tensors: list[torch.Tensor]) -> torch.Tensor:  # made outside inference mode: autograd may save it
        out = tensors[0].new_zeros(len(tensors), width, *tensors[0].shape[1:])
        for row, tensor in enumerate(tensors):
            out[row, : len(tensor)] = tensor
        return out

    last = padded([hidden for hidden, _ in rows])
    features = padded([captured for _, captured in rows]) if layers is not None else None
    top1 = padded([target.logits(hidden).argmax(-1) for hidden, _ in rows]) if with_top1 else None
    return features, last, top1


def padded_forward(model, input_ids: torch.Tensor, valid: torch.Tensor, layers: list[int] | None, with_top1: bool):
    """target_features as one forward over the padded batch."""
    device = next(model.parameters()).device
    rounded = kv_dtype(model)  # a GGUF base on the grouped kernels: keys and values rounded as the engine caches them
    out = model.model(input_ids=input_ids.to(device), attention_mask=valid.long().to(device),
                      past_key_values=GrowingCache(rounded) if rounded else None,
                      output_hidden_states=layers is not None)
    last = out.last_hidden_state
    top1 = model.get_output_embeddings()(last).argmax(-1) if with_top1 else None
    # hidden_states[i] is the input of decoder layer i (entry 0 = embeddings), the official capture point
    features = torch.cat([out.hidden_states[i] for i in layers], -1) if layers is not None else None
    return features, last, top1


def _batches_by_tokens(records: list[dict], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that each padded batch holds at most max_tokens (longest first within the group)."""
    order = sorted(range(len(records)), key=lambda i: -len(records[i]["input_ids"]))
    groups, current = [], []
    for i in order:
        width = len(records[current[0]]["input_ids"]) if current else len(records[i]["input_ids"])
        if current and width * (len(current) + 1) > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    return groups + ([current] if current else [])


def cache_features(model, records: list[dict], folder: str | Path, kind: str, max_tokens: int = 4096,
                   dtype: torch.dtype = torch.bfloat16, layers: list[int] | None = None) -> Path:
    """Write the features of every record into `folder` (resumable); returns the folder. layers: the decoder layers
    the head fuses (default: the official capture for `kind`; a fine-tuned head's config may name others)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = layers or feature_layers(kind, model.config.num_hidden_layers)
    meta = {"kind": kind, "layers": layers, "count": len(records), "ids": [r["id"] for r in records]}
    meta_file = folder / "meta.json"
    if meta_file.exists() and json.loads(meta_file.read_text()) != meta:
        raise ValueError(f"{folder} holds features of other data or another head kind; choose an empty folder")
    meta_file.write_text(json.dumps(meta))
    target = Target(model)  # the engine's runner over the model, one for every batch
    chunks = range(0, len(records), CHUNK)
    for start in progress_bar(iterable=chunks, desc="target features", unit="chunk"):
        path = folder / f"chunk_{start // CHUNK:05d}.safetensors"
        if path.exists():
            continue
        part = records[start:start + CHUNK]
        rows: dict[int, dict[str, torch.Tensor]] = {}
        for group in _batches_by_tokens(part, max_tokens):
            batch = pad_batch([part[i] for i in group])
            features, last, top1 = target_features(target, batch["input_ids"], batch["valid"], layers)
            for row, i in enumerate(group):
                n = len(part[i]["input_ids"])
                rows[i] = {"last": last[row, :n].to(dtype).cpu(), "top1": top1[row, :n].int().cpu()}
                if features is not None:
                    rows[i]["features"] = features[row, :n].to(dtype).cpu()
        lengths = torch.tensor([len(r["input_ids"]) for r in part])
        tensors = {name: torch.cat([rows[i][name] for i in range(len(part))]) for name in rows[0]}
        tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.rename(path)
    return folder


class CachedFeatures:
    """Features of record i read lazily from the cache (only the rows needed are loaded)."""

    def __init__(self, folder: str | Path, records: list[dict]):
        self.folder = Path(folder)
        meta = json.loads((self.folder / "meta.json").read_text())
        if meta["ids"] != [r["id"] for r in records]:
            raise ValueError(f"the feature cache {self.folder} was computed for other data")
        self.kind, self.records, self._files = meta["kind"], records, {}

    def _file(self, chunk: int):
        if chunk not in self._files:
            path = self.folder / f"chunk_{chunk:05d}.safetensors"
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing; rerun the features stage")
            self._files[chunk] = safe_open(str(path), framework="pt")
        return self._files[chunk]

    def item(self, index: int) -> dict[str, torch.Tensor]:
        handle = self._file(index // CHUNK)
        offsets = handle.get_tensor("offsets")
        a, b = offsets[index % CHUNK].item(), offsets[index % CHUNK + 1].item()
        names = ["last", "top1"] + (["features"] if self.kind == "eagle3" else [])
        return {name: handle.get_slice(name)[a:b] for name in names}

    def batch(self, indices: list[int], with_top1: bool = True) -> dict[str, torch.Tensor]:
        batch = pad_batch([self.records[i] for i in indices])
        items = [self.item(i) for i in indices]
        width = batch["input_ids"].shape[1]
        for name in items[0]:
            padded = torch.zeros(len(items), width, *items[0][name].shape[1:], dtype=items[0][name].dtype)
            for row, item in enumerate(items):
                padded[row, :len(item[name])] = item[name]
            batch[name] = padded
        batch["top1"] = batch["top1"].long()
        if not with_top1:
            del batch["top1"]
        if self.kind == "eagle1":
            batch["features"] = batch["last"]
        return batch


class LiveFeatures:
    """The same batches as CachedFeatures, computed by the base model on demand (no disk)."""

    def __init__(self, model, records: list[dict], kind: str, layers: list[int] | None = None):
        self.model, self.records, self.kind = model, records, kind
        self.target = Target(model)  # the engine's runner over the model, one for every batch
        self.layers = layers or feature_layers(kind, model.config.num_hidden_layers)

    def batch(self, indices: list[int], with_top1: bool = True) -> dict[str, torch.Tensor]:
        batch = pad_batch([self.records[i] for i in indices])
        features, last, top1 = target_features(self.target, batch["input_ids"], batch["valid"], self.layers,
                                               with_top1)
        batch.update(last=last, features=last if features is None else features)  # stay where the losses run
        if top1 is not None:
            batch["top1"] = top1
        return batch
