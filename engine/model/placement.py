"""Spread a base model over several GPUs for `--device auto`, keeping what the draft head touches on one device.

The draft head reads the base model's input embedding, its LM head (EAGLE-1) and its last features, so the
embedding, the final norm and the LM head sit with the last decoder layers, and the head goes there too. Decoder
layers are split into contiguous runs, one per GPU, balanced by bytes and capped by each GPU's budget, so a
verification forward crosses each device boundary once (hidden states, a few kilobytes per token).

The split itself (`split_layers`, `device_map_for`, `head_device`) is pure and unit-tested with fake devices;
`plan_device_map` measures a meta-device skeleton of the model and the visible GPUs' free memory around it, and
keeps the whole model on one GPU when it fits there: a split is for models that one GPU cannot hold.
"""
from __future__ import annotations

import torch
from torch import nn

Device = int | str  # what transformers' device_map accepts: a GPU index, "cpu", "cuda:1", ...

# Bytes per weight element of the linear layers bitsandbytes replaces: 8-bit stores one byte plus an fp32 scale
# per output row; NF4 stores half a byte plus one absmax byte per 64-weight block with double quantization.
QUANTIZED_BYTES = {"8bit": 1.0, "4bit": 0.5 + 1 / 64}
HEADROOM = 0.15  # share of each GPU's free memory left for the KV cache, activations and the CUDA context


def wait_for(device: torch.device) -> None:
    """Wait for the work queued on a GPU, so that a timer read next measures it (the CPU runs each op to its end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _even_shares(total: float, budgets: dict[Device, int]) -> dict[Device, float]:
    """Equal loads, except that a device never gets more than its budget (the rest spills onto the others)."""
    shares, left, open_ = {}, float(total), sorted(budgets, key=budgets.get)
    while open_:
        even = left / len(open_)
        if budgets[open_[0]] >= even:
            shares.update(dict.fromkeys(open_, even))
            break
        device = open_.pop(0)
        shares[device] = budgets[device]
        left -= budgets[device]
    return shares


def split_layers(layer_bytes: list[int], anchored_bytes: int, budgets: dict[Device, int]) -> list[Device]:
    """Device of each decoder layer: contiguous runs in `budgets` order; the last device also holds
    `anchored_bytes` (embedding, final norm, LM head, draft head). Loads are balanced and within budget."""
    if not budgets:
        raise ValueError("no device to place the model on")
    devices = list(budgets)
    total = sum(layer_bytes) + anchored_bytes
    if total > sum(budgets.values()):
        raise MemoryError(
            f"the model needs about {total / 2**30:.2f} GiB but the devices offer "
            f"{sum(budgets.values()) / 2**30:.2f} GiB ({_gib(budgets)}); quantize it (--quantization 4bit), "
            "raise --max-memory if it capped them, or choose a smaller model"
        )
    shares = _even_shares(total, budgets)
    loads = dict.fromkeys(devices, 0)
    loads[devices[-1]] = anchored_bytes
    placement, index, unplaced = [], 0, sum(layer_bytes)
    for size in layer_bytes:
        while index < len(devices) - 1:
            device = devices[index]
            room_after = sum(budgets[d] - loads[d] for d in devices[index + 1:])
            fits = loads[device] + size <= budgets[device]
            # Take the layer if that brings the load nearer its share, or if the later devices cannot hold the rest.
            if fits and (loads[device] + size / 2 <= shares[device] or unplaced > room_after):
                break
            index += 1
        device = devices[index]
        loads[device] += size
        unplaced -= size
        placement.append(device)
    over = {d: loads[d] - budgets[d] for d in devices if loads[d] > budgets[d]}
    if over:
        raise MemoryError(
            f"no contiguous split of {len(layer_bytes)} layers fits the budgets ({_gib(budgets)}); "
            f"device {next(iter(over))} would be {max(over.values()) / 2**30:.2f} GiB over: raise --max-memory"
        )
    return placement


def _gib(budgets: dict[Device, int]) -> str:
    return ", ".join(f"{d}: {b / 2**30:.2f} GiB" for d, b in budgets.items())


def device_map_for(model: nn.Module, layer_devices: list[Device]) -> dict[str, Device]:
    """A transformers `device_map` for `model`: decoder layers where `layer_devices` says, every other module
    (embedding, rotary embedding, final norm, LM head, wrappers' extras) on the last layer's device."""
    decoder = model.get_decoder()
    if len(decoder.layers) != len(layer_devices):
        raise ValueError(f"{len(layer_devices)} devices given for {len(decoder.layers)} decoder layers")
    anchor = layer_devices[-1]
    path = next(name for name, module in model.named_modules() if module is decoder).split(".")
    device_map = {}
    for depth, step in enumerate(path):  # siblings of the decoder and of each of its parents
        parent = ".".join(path[:depth])
        for name, _ in model.get_submodule(parent).named_children():
            if name != step:
                device_map[f"{parent}.{name}".lstrip(".")] = anchor
    prefix = ".".join(path)
    for name, module in decoder.named_children():
        if module is decoder.layers:
            device_map.update({f"{prefix}.{name}.{i}": device for i, device in enumerate(layer_devices)})
        else:
            device_map[f"{prefix}.{name}"] = anchor
    return device_map


def head_device(device_map: dict[str, Device], module: str = "lm_head") -> Device:
    """The device a `device_map` gives `module` (the most specific entry that covers it): where the head goes."""
    covering = [key for key in device_map if key == "" or module == key or module.startswith(key + ".")]
    if not covering:
        raise KeyError(f"the device map does not place {module}")
    return device_map[max(covering, key=len)]


def module_bytes(module: nn.Module, float_bytes: int, quantization: str = "none") -> int:
    """Memory of a module once loaded: float parameters at `float_bytes`, quantized linear weights less."""
    quantized = set()
    if quantization != "none":
        quantized = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    total = 0.0
    for tensor in [*module.parameters(), *module.buffers()]:
        per = QUANTIZED_BYTES[quantization] if id(tensor) in quantized else float_bytes
        total += tensor.numel() * per
    return int(total)


def gpu_budgets(max_memory: str | int | None = None, indices: list[int] | None = None) -> dict[int, int]:
    """Bytes each GPU in `indices` (default: every visible one) may hold: its free memory less HEADROOM, capped by
    `max_memory` (e.g. "20GiB")."""
    from accelerate.utils import convert_file_size_to_int

    cap = convert_file_size_to_int(max_memory) if max_memory is not None else None
    budgets = {}
    for index in range(torch.cuda.device_count()) if indices is None else indices:
        free, _ = torch.cuda.mem_get_info(index)
        budget = int(free * (1 - HEADROOM))
        budgets[index] = budget if cap is None else min(budget, cap)
    return budgets


def _skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model built on the meta device: its modules and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _footprint(skeleton: nn.Module, dtype: torch.dtype, quantization: str) -> tuple[list[int], int]:
    """Bytes of each decoder layer, and of what stays with the LM head plus a draft head (one float layer)."""
    float_bytes = torch.finfo(dtype).bits // 8
    layers = skeleton.get_decoder().layers
    layer_bytes = [module_bytes(layer, float_bytes, quantization) for layer in layers]
    # Everything outside the decoder layers stays in float (bitsandbytes skips the LM head and embeddings).
    anchored = module_bytes(skeleton, float_bytes) - sum(module_bytes(layer, float_bytes) for layer in layers)
    return layer_bytes, anchored + module_bytes(layers[0], float_bytes)


def model_bytes(config, dtype: torch.dtype, quantization: str = "none") -> int:
    """Memory the loaded model takes, with room for a draft head: what a device must offer to hold it all."""
    layer_bytes, anchored = _footprint(_skeleton(config, dtype), dtype, quantization)
    return sum(layer_bytes) + anchored


def plan_device_map(
    config, dtype: torch.dtype, quantization: str = "none", budgets: dict[Device, int] | None = None
) -> dict[str, Device]:
    """The device_map for a model on GPUs: all of it on the first device of `budgets` (default: the visible GPUs'
    free memory) when it fits there, else decoder layers balanced over them. One device saves the cross-device copies
    and accelerate's hooks on every module call that a split costs."""
    budgets = gpu_budgets() if budgets is None else budgets
    skeleton = _skeleton(config, dtype)
    layer_bytes, anchored = _footprint(skeleton, dtype, quantization)
    first = next(iter(budgets), None)
    if first is not None and sum(layer_bytes) + anchored <= budgets[first]:
        return {"": first}
    return device_map_for(skeleton, split_layers(layer_bytes, anchored, budgets))
