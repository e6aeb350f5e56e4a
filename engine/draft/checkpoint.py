"""Read draft heads in the layouts they are published in (config.json + model.safetensors or pytorch_model.bin), and
write them in the official EAGLE layout.

Layouts (engine/draft/config.py reads their configs; the layout is told from config.json, never the folder's name):

  official     the EAGLE authors' heads: midlayer.* (EAGLE-3) or layers.* (EAGLE-1), fc, norm, lm_head, d2t, t2d
  specforge    SpecForge / SGLang EAGLE-3 heads: the official tensor names, usually with embed_tokens
  speculators  vLLM speculators heads: EAGLE-3 as layers.0.* for midlayer.*; EAGLE-1 as fusion_fc and transformer.*
               for fc and layers.0.*; their copies of the verifier's norm and LM head (training targets) are dropped

Every layout loads into the same head modules. Unlike the official loader (strict=False), every key is checked: a
missing, unexpected or mis-shaped tensor is an error that names it as the file does, a missing or unsupported config
field is named with the file, and a head whose sizes do not fit the base model is refused with both sets of sizes.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from .config import AUX_LAYERS, HeadConfig, detect_layout, layout_fields
from .eagle1 import Eagle1Head
from .eagle3 import Eagle3Head, fused_layers
from .head import DraftHead

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DEFAULT_HEAD = ASSETS / "smollm2-135m-eagle3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Bytes a value of each safetensors dtype takes.
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_HEADS = {"eagle1": Eagle1Head, "eagle3": Eagle3Head}
# Tensor name prefixes a layout uses where the official layout's differ: (the layout's, the official).
_RENAMES = {
    ("speculators", "eagle3"): (("layers.0.", "midlayer."),),
    ("speculators", "eagle1"): (("fusion_fc.", "fc."), ("transformer.", "layers.0.")),
}
# Tensors a layout may save that drafting never reads: speculators' frozen copies of the verifier's final norm and
# LM head, which only give its training targets.
_TRAINING_ONLY = {"speculators": ("verifier_norm.weight", "verifier_lm_head.weight")}


class CheckpointError(ValueError):
    """A head checkpoint that cannot be used: unreadable, incomplete, or made for another base model."""


def new_head(kind: str, base_config, draft_vocab_size: int | None = None) -> DraftHead:
    """A randomly initialised head sized for `base_config` (a transformers config)."""
    if kind not in _HEADS:
        raise ValueError(f"unknown head kind {kind!r}; choose eagle1 or eagle3")
    text = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    rope = getattr(text, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # a base with a RoPE per layer type (Gemma 3): its global layers'
    raw = {
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "vocab_size": text.vocab_size,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
        "bias": True,
        "draft_vocab_size": draft_vocab_size or text.vocab_size,
        # the base's context, which servers otherwise cap at a Llama config's default of 2,048 tokens
        "max_position_embeddings": getattr(text, "max_position_embeddings", None) or 2048,
    }
    layers = fused_layers(text.num_hidden_layers)
    if kind == "eagle3" and len(set(layers)) == 3:  # the config names the layers it fuses, so every server reads the
        raw[AUX_LAYERS] = layers  # same ones (a base too shallow for three distinct ones keeps the default rule)
    return _HEADS[kind](HeadConfig.from_dict(raw, kind))


def head_folder(source: str | Path) -> Path:
    """The local folder of a head: `source` itself, or a hub id's snapshot (its config and weights fetched)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if str(source).startswith((".", "/", "~")) or str(source).count("/") != 1:
        raise CheckpointError(f"head {source} is neither a folder nor a hub id")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(source), allow_patterns=["config.json", *WEIGHT_FILES]))


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.exists():
            continue
        problem = _safetensors_problem(file) if file.suffix == ".safetensors" else None
        if problem:
            raise CheckpointError(f"cannot read {file}: {problem}")
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # safetensors and torch raise many types for damaged files
            raise CheckpointError(f"cannot read {file}: the file is corrupt or truncated ({err})") from err
    raise CheckpointError(f"{folder} has no {' or '.join(WEIGHT_FILES)}")


def _safetensors_problem(file: Path) -> str | None:
    """Which tensor a safetensors file's header places where it cannot be: past the file's end (a file cut short) or
    over a span that does not hold its shape. None where the header fits the file, or is not one to check (unreadable
    JSON, a dtype not listed): load_file then judges it."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        try:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length)) if 8 + length <= size else None
        except (struct.error, ValueError):
            return None
    for name, entry in header.items() if isinstance(header, dict) else ():
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            dtype, shape = entry["dtype"], [int(n) for n in entry["shape"]]
            need = math.prod(shape) * SAFETENSORS_BYTES[dtype]
        except (KeyError, TypeError, ValueError):  # __metadata__, or a field safetensors will name
            continue
        if end - begin != need:
            return (f"its header places {name} at data bytes {begin:,} to {end:,}, but {dtype} {shape} takes "
                    f"{need:,} bytes (the header is damaged)")
        if 8 + length + end > size:
            return (f"the file is truncated: {name} ends at byte {8 + length + end:,}, but the file holds {size:,} "
                    "(an interrupted download or copy?)")
    return None


def _kind(raw: dict, state: dict[str, torch.Tensor]) -> str:
    if any(k.startswith("midlayer.") for k in state) or "draft_vocab_size" in raw:
        return "eagle3"
    if any(k.startswith("layers.") for k in state):
        return "eagle1"
    raise CheckpointError("cannot tell the head kind: no midlayer.* (EAGLE-3) or layers.* (EAGLE-1) keys")


def check_fits(config: HeadConfig, base_config, head_name: str, base_name: str, own_embeddings: bool = False) -> None:
    """Refuse a head whose sizes differ from the base model's, naming both. own_embeddings: the checkpoint ships
    embed_tokens, so the head's width may differ from the base's (a head that borrows the base's may not)."""
    text = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    target_hidden = config.target_hidden_size or config.hidden_size
    problems = []
    if target_hidden != text.hidden_size:
        problems.append(f"feature width {target_hidden} vs base hidden_size {text.hidden_size}")
    elif config.hidden_size != text.hidden_size and not own_embeddings:
        problems.append(f"hidden_size {config.hidden_size} vs base hidden_size {text.hidden_size}, and no "
                        "embed_tokens.weight of its own to embed tokens at its width")
    if config.vocab_size != text.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} vs base vocab_size {text.vocab_size}")
    if config.kind == "eagle3":
        problems += _fused_layer_problems(config, text.num_hidden_layers)
    if problems:
        raise CheckpointError(
            f"head {head_name} ({config.kind}, {config.layout} layout, hidden_size {config.hidden_size}, "
            f"vocab_size {config.vocab_size}) "
            f"does not fit base model {base_name} (hidden_size {text.hidden_size}, vocab_size {text.vocab_size}, "
            f"{text.num_hidden_layers} layers): " + "; ".join(problems)
        )


def _fused_layer_problems(config: HeadConfig, num_layers: int) -> list[str]:
    if config.target_layers is None:
        if len(set(fused_layers(num_layers))) < 3:
            return [f"an EAGLE-3 head needs a base with at least 7 layers, it has {num_layers}"]
        return []
    past = [i for i in config.target_layers if i >= num_layers]
    if past:
        return [f"fused target layers {config.target_layers} (inputs of base decoder layers) need a base with more "
                f"than {max(past)} layers, it has {num_layers}"]
    return []


def _official_names(state: dict[str, torch.Tensor], layout: str, kind: str | None
                    ) -> tuple[dict[str, torch.Tensor], Callable[[str], str]]:
    """The checkpoint's tensors under the official names, and how the file names a tensor (for error messages)."""
    renames = _RENAMES.get((layout, kind), ())

    def official(name: str) -> str:
        for theirs, ours in renames:
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs)
        return name

    def as_in_file(name: str) -> str:
        for theirs, ours in renames:
            if name.startswith(ours):
                return theirs + name.removeprefix(ours)
        return name

    dropped = _TRAINING_ONLY.get(layout, ())
    return {official(k): v for k, v in state.items() if k not in dropped}, as_in_file


def _check_fused_count(config: HeadConfig, state: dict[str, torch.Tensor]) -> None:
    """A head fusing other than three target layers must name them: the official default names three."""
    fc = state.get("fc.weight")
    if config.kind != "eagle3" or config.target_layers or fc is None or fc.dim() != 2:
        return
    count, rest = divmod(fc.shape[1], config.target_hidden_size or config.hidden_size)
    if rest == 0 and count != 3:
        field = f"eagle_config.{AUX_LAYERS}" if config.layout == "specforge" else AUX_LAYERS
        raise ValueError(f"fc.weight fuses {count} target layers but {field} is absent, so which {count} cannot be "
                         "told")


def read_layout(raw: dict, state: dict[str, torch.Tensor]
                ) -> tuple[HeadConfig, dict[str, torch.Tensor], Callable[[str], str]]:
    """The head config of any layout, its tensors under the official names, and how the file names a tensor.
    ValueError names the config field at fault."""
    layout = detect_layout(raw)
    fields, kind = layout_fields(raw, layout)
    state, as_in_file = _official_names(state, layout, kind)
    config = HeadConfig.from_dict(fields, kind or _kind(fields, state), layout)
    _check_fused_count(config, state)
    return config, state, as_in_file


def read_checkpoint(source: str | Path) -> tuple[Path, HeadConfig, dict[str, torch.Tensor], Callable[[str], str]]:
    """A head folder (or hub id) in any layout: its folder, its config and tensors under the official names, and how
    the file names each tensor (for error messages)."""
    folder = head_folder(source)
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{folder} has no config.json") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from err
    state = _read_weights(folder)
    try:
        config, state, as_in_file = read_layout(raw, state)
    except ValueError as err:
        raise CheckpointError(f"{config_file}: {err}") from err
    return folder, config, state, as_in_file


def load_head(source: str | Path, base_model: nn.Module, dtype: torch.dtype | None = None) -> DraftHead:
    """Load a head for `base_model` from a folder or hub id, check it fits, and attach the base embeddings."""
    _, config, state, as_in_file = read_checkpoint(source)
    base_name = getattr(base_model.config, "name_or_path", "") or type(base_model).__name__
    own_embeddings = "embed_tokens.weight" in state
    check_fits(config, base_model.config, str(source), base_name, own_embeddings)

    head = _HEADS[config.kind](config)
    if own_embeddings:  # the head's own table, used instead of the base model's
        head.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    if config.kind == "eagle3" and not head.has_vocab_map:
        state.pop("d2t", None), state.pop("t2d", None)  # identity vocabulary, as the official loader does
    _check_tensors(head, state, f"head {source}", f"the {config.layout} {config.kind} layout", as_in_file)
    head.load_state_dict(state, strict=True)
    return place_head(head, base_model, dtype)


def _check_tensors(head: DraftHead, state: dict[str, torch.Tensor], head_name: str, layout: str,
                   as_in_file: Callable[[str], str]) -> None:
    """Name every missing, unexpected or mis-shaped tensor as the file names it."""
    expected = head.state_dict()
    missing = sorted(as_in_file(k) for k in set(expected) - set(state))
    unexpected = sorted(as_in_file(k) for k in set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{head_name} does not match {layout}:"
            + (f" missing {', '.join(missing)}" if missing else "")
            + (f" unexpected {', '.join(unexpected)}" if unexpected else "")
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise CheckpointError(f"{head_name}: {as_in_file(key)} has shape {list(tensor.shape)}, config.json "
                                  f"implies {list(expected[key].shape)}")


def place_head(head: DraftHead, base_model: nn.Module, dtype: torch.dtype | None = None) -> DraftHead:
    """Attach the base embeddings and move the head beside the base model's LM head, in eval mode."""
    lm_head = base_model.get_output_embeddings()
    device = lm_head.weight.device
    float_dtype = dtype or (lm_head.weight.dtype if lm_head.weight.is_floating_point() else torch.float32)
    head.to(device=device, dtype=float_dtype).eval().requires_grad_(False)
    head.attach(base_model)
    return head


def save_head(head: DraftHead, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors; the borrowed base embedding is never written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, tensor in head.state_dict().items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[key] = tensor.detach().cpu().contiguous()
    # Plain bytes, not save_file, which creates the file owner-only (0600): a head is meant to be shared.
    (folder / "model.safetensors").write_bytes(save(state, metadata={"format": "pt"}))
    config = head.config.to_dict()
    config["torch_dtype"] = str(dtype or head.fc.weight.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
