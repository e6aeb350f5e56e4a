"""A GGUF file's tensor table and raw blocks, read in milliseconds.

gguf-py's GGUFReader parses every metadata field into numpy views first: for a vocabulary of 49k tokens and merges
that takes seconds, for a few hundred tensors the quantized kernels need. This walks the metadata only to
skip it (keeping the architecture name and the data alignment) and memory-maps the tensor data
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3).
"""
from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .groups import BLOCK_SHAPES, BLOCK_TYPES

# The float types read as values: type id -> (name, bytes a value).
FLOAT_TYPES = {0: ("F32", 4), 1: ("F16", 2), 30: ("BF16", 2)}

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorBlocks:
    """One tensor as GGUF stores it: `shape` in GGUF's order (fastest-varying first), `blocks` [rows, bytes per
    row] uint8 for the grouped types (engine.model.groups) and the float ones (None for other types)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    blocks: np.ndarray | None

    @property
    def grouped(self) -> bool:
        return self.kind in BLOCK_SHAPES

    def floats(self) -> np.ndarray:
        """A float tensor's values as float32, in numpy's order (slowest-varying first)."""
        raw = self.blocks.reshape(-1)
        if self.kind == "BF16":
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(np.float32 if self.kind == "F32" else np.float16).astype(np.float32)
        return values.reshape(self.shape[::-1])


class _Cursor:
    def __init__(self, data: mmap.mmap):
        self.data, self.at = data, 0

    def scalar(self, code: str):
        (value,) = struct.unpack_from("<" + code, self.data, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        self.at += length
        return bytes(self.data[self.at - length : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            length = self.scalar("Q")  # read before the position moves past it
            self.at += length
        elif kind == _ARRAY:
            element, count = self.scalar("I"), self.scalar("Q")
            if element in _SCALARS:
                self.at += count * struct.calcsize(_SCALARS[element])
            else:
                for _ in range(count):
                    self.skip_value(element)
        else:
            self.at += struct.calcsize(_SCALARS[kind])


def read_tensors(path: Path) -> tuple[str, list[TensorBlocks]]:
    """(general.architecture, every tensor) of a GGUF file; the blocks are read-only views of the mapped file.
    A file that is empty, cut short or not GGUF is refused with a ValueError that names it."""
    if Path(path).stat().st_size == 0:
        raise ValueError(f"{path} is empty")
    try:
        return _read_tensors(path)
    except (struct.error, UnicodeDecodeError, OverflowError, IndexError) as err:
        raise ValueError(f"{path} is not a readable GGUF file: its header is damaged ({err})") from None


def _read_tensors(path: Path) -> tuple[str, list[TensorBlocks]]:
    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    cursor.at = 4
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensors, fields = cursor.scalar("Q"), cursor.scalar("Q")
    architecture, alignment = "", 32
    for _ in range(fields):
        key, kind = cursor.string(), cursor.scalar("I")
        if key == "general.architecture" and kind == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and kind in _SCALARS:
            alignment = cursor.scalar(_SCALARS[kind])
        else:
            cursor.skip_value(kind)
    table = []
    for _ in range(tensors):
        name, dims = cursor.string(), cursor.scalar("I")
        shape = tuple(cursor.scalar("Q") for _ in range(dims))
        table.append((name, shape, cursor.scalar("I"), cursor.scalar("Q")))
    start = -(-cursor.at // alignment) * alignment
    _check_complete(path, len(data), start, table)
    return architecture, [_blocks(data, start, *entry) for entry in table]


def _check_complete(path: Path, size: int, start: int, table: list[tuple]) -> None:
    """Refuse a file cut short (an interrupted download or copy) before any tensor is read from it."""
    need = max((start + offset + _data_bytes(shape, kind) for _, shape, kind, offset in table), default=start)
    if need > size:
        raise ValueError(f"{path} is truncated: its tensors need {need:,} bytes but the file holds {size:,} "
                         "(an interrupted download or copy?)")


def _data_bytes(shape: tuple[int, ...], kind: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # here: the kernels' own path needs no gguf package

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        return 0  # a type this gguf does not know: its size is transformers' to judge
    return int(np.prod(shape)) // block * block_bytes


def _blocks(data: mmap.mmap, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int) -> TensorBlocks:
    if kind not in BLOCK_TYPES and kind not in FLOAT_TYPES:
        return TensorBlocks(name, _type_name(kind), shape, None)
    label, weights, size = BLOCK_TYPES[kind] if kind in BLOCK_TYPES else (FLOAT_TYPES[kind][0], 1,
                                                                          FLOAT_TYPES[kind][1])
    rows, row_bytes = int(np.prod(shape[1:])), shape[0] // weights * size
    blocks = np.frombuffer(data, dtype=np.uint8, count=rows * row_bytes, offset=start + offset)
    return TensorBlocks(name, label, shape, blocks.reshape(rows, row_bytes))


def tensor_names(architecture: str, layers: int):
    """gguf's map from transformers' module names to the GGUF tensor names of `architecture` (None: an
    architecture gguf does not know)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map  # here: reading a file's tensors needs no gguf package

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    return None if arch is None else get_tensor_name_map(arch, layers)


def gguf_name(names, parameter: str) -> str | None:
    """The GGUF tensor name of a transformers parameter ("model.layers.0.self_attn.q_proj.weight" ->
    "blk.0.attn_q.weight"), by a tensor_names map; None where the map has no name for its module."""
    module, _, kind = parameter.rpartition(".")
    base = names.get_name(module)
    return None if base is None else f"{base}.{kind}"


def read_metadata(path: Path) -> tuple[dict[str, object], dict[str, int]]:
    """A GGUF's metadata: scalars and strings by key, and arrays' lengths by key (a vocabulary of 49k tokens is
    counted, not parsed). For files read_tensors accepted, whose header is whole."""
    values, lengths = {}, {}
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        cursor.at = 16  # past the magic, the version and the tensor count
        for _ in range(cursor.scalar("Q")):
            key, kind = cursor.string(), cursor.scalar("I")
            if kind == _STRING:
                values[key] = cursor.string()
            elif kind == _ARRAY:
                lengths[key] = struct.unpack_from("<Q", data, cursor.at + 4)[0]  # after the element type
                cursor.skip_value(kind)
            else:
                values[key] = cursor.scalar(_SCALARS[kind])
    return values, lengths


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type a GGUF file holds, most common first: what a user's file is made of."""
    return dict(Counter(tensor.kind for tensor in read_tensors(path)[1]).most_common())


def _type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType  # here: reading the kernels' own types needs no gguf package

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"
