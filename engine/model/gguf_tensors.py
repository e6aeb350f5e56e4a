"""A GGUF file's tensor table and raw blocks, read in milliseconds.

gguf-py's GGUFReader parses every metadata field into numpy views first: for a vocabulary of 49k tokens and merges
that takes seconds, for a few hundred tensors the quantized kernels need. This walks the metadata only to
skip it (keeping the architecture name and the data alignment) and memory-maps the tensor data
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3).
"""
from __future__ import annotations

import math
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
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


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


class _Damaged(Exception):
    """What is wrong with a GGUF header, found while walking it."""


class _Cursor:
    """A walk through a GGUF header that never reads past the file's end: `reading` names the part being read, for
    the message when it would."""

    def __init__(self, data: mmap.mmap):
        self.data, self.at, self.reading = data, 0, "the header"

    def step(self, size: int) -> int:
        """Move past `size` bytes; where they start."""
        start, self.at = self.at, self.at + size
        if self.at > len(self.data):
            raise _Damaged(f"{self.reading} runs past the end of the file, at {len(self.data):,} bytes")
        return start

    def expect(self, count: int, least_bytes: int, what: str) -> None:
        """Refuse a count of entries of at least `least_bytes` each that the rest of the file cannot hold: a lying
        count fails at once instead of walking a large file's data as entries."""
        left = len(self.data) - self.at
        if count * least_bytes > left:
            raise _Damaged(f"{count:,} {what} cannot fit in the {left:,} bytes left of the file's "
                           f"{len(self.data):,}: it is cut short or the count is wrong")

    def scalar(self, code: str):
        (value,) = struct.unpack_from("<" + code, self.data, self.step(struct.calcsize(code)))
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.step(length)
        return bytes(self.data[start : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.step(self.scalar("Q"))
        elif kind == _ARRAY:
            element, count = self.scalar("I"), self.scalar("Q")
            if element in _SCALARS:
                self.step(count * struct.calcsize(_SCALARS[element]))
            else:
                self.expect(count, 8, "array elements")  # a string or an array takes 8 bytes at least
                for _ in range(count):
                    self.skip_value(element)
        elif kind in _SCALARS:
            self.step(struct.calcsize(_SCALARS[kind]))
        else:
            raise _Damaged(f"{self.reading} has value type {kind}, which GGUF does not define")


def read_tensors(path: Path) -> tuple[str, list[TensorBlocks]]:
    """(general.architecture, every tensor) of a GGUF file; the blocks are read-only views of the mapped file.
    A file that is empty, cut short, not GGUF or whose header is damaged is refused with a ValueError that names it
    and what is wrong."""
    if Path(path).stat().st_size == 0:
        raise ValueError(f"{path} is empty")
    try:
        return _read_tensors(path)
    except _Damaged as err:
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
    cursor.expect(fields, 13, "metadata entries")  # key length, value type, one byte
    architecture, alignment = "", 32
    for field in range(fields):
        cursor.reading = f"metadata entry {field + 1} of {fields:,}"
        key, kind = cursor.string(), cursor.scalar("I")
        if key == "general.architecture" and kind == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and kind in _SCALARS:
            alignment = cursor.scalar(_SCALARS[kind])
        else:
            cursor.skip_value(kind)
    if alignment < 1 or alignment & (alignment - 1):
        raise _Damaged(f"general.alignment is {alignment}, not a power of two")
    cursor.expect(tensors, 24, "tensor entries")  # name length, dimensions, type, offset
    table = []
    for tensor in range(tensors):
        cursor.reading = f"tensor entry {tensor + 1} of {tensors:,}"
        name, dims = cursor.string(), cursor.scalar("I")
        if dims > MAX_DIMS:
            raise _Damaged(f"{cursor.reading} ({name!r}) has {dims:,} dimensions; GGUF allows {MAX_DIMS}")
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
    return math.prod(shape) // block * block_bytes  # exact for any size a damaged header states


def _blocks(data: mmap.mmap, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int) -> TensorBlocks:
    if kind not in BLOCK_TYPES and kind not in FLOAT_TYPES:
        return TensorBlocks(name, _type_name(kind), shape, None)
    label, weights, size = BLOCK_TYPES[kind] if kind in BLOCK_TYPES else (FLOAT_TYPES[kind][0], 1,
                                                                          FLOAT_TYPES[kind][1])
    rows, row_bytes = math.prod(shape[1:]), shape[0] // weights * size
    blocks = np.frombuffer(data, dtype=np.uint8, count=rows * row_bytes, offset=start + offset)
    return TensorBlocks(name, label, shape, blocks.reshape(rows, row_bytes))


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file opened once for a load: its path, architecture and tensor table, read by read_tensors and passed
    to whoever needs them (the loader, the kernels' matching, the description) instead of read again by each."""

    path: Path
    architecture: str
    tensors: tuple[TensorBlocks, ...]

    @classmethod
    def open(cls, path: Path | str) -> GgufFile:
        """Read `path`'s tensor table; a file that is empty, cut short or not GGUF is refused by name (ValueError)."""
        architecture, tensors = read_tensors(Path(path))
        return cls(Path(path), architecture, tuple(tensors))

    @property
    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each type the file holds, most common first: what a user's file is made of."""
        return dict(Counter(tensor.kind for tensor in self.tensors).most_common())


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


def _type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType  # here: reading the kernels' own types needs no gguf package

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"
