"""A weight as a GGUF type's groups of 32: whole-number codes, a float scale per group (or per 16 weights) and
a min per group where the type has one. Every type the kernels take is read into this one form, keeping the file's
numbers, so that w = scale * q + min gives back the very float32 weights gguf-py's dequantize (and so transformers)
gives:

    type   codes q                    scale                 min
    Q4_0   4-bit, 0..15               d                     -8 d
    Q4_1   4-bit, 0..15               d                     m
    Q5_0   8-bit, -16..15             d                     -
    Q5_1   8-bit, 0..31               d                     m
    Q8_0   8-bit, -127..127           d                     -
    Q4_K   4-bit, 0..15               d * scale_j           -dmin * min_j     (j: the group in its block of 256)
    Q5_K   8-bit, 0..31               d * scale_j           -dmin * min_j
    Q6_K   8-bit, -32..31             d * scale_j, per 16   -

Every product scale * q is exact in float32 (a float16 times at most 17 bits), so each weight is rounded once, at
the sum, as gguf-py rounds it. 4-bit codes are kept as GGUF keeps Q4_0/Q4_1 (byte j of a group: element j low,
element j + 16 high), half the bytes of 8-bit ones; the 5- and 6-bit codes take a byte each.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
SUPER = 256  # weights per K-quant block
# The GGML types read into Groups: type id -> (name, weights a block, bytes a block), as ggml defines them.
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
               8: ("Q8_0", 32, 34), 12: ("Q4_K", SUPER, 144), 13: ("Q5_K", SUPER, 176), 14: ("Q6_K", SUPER, 210)}
BLOCK_SHAPES = {name: (weights, size) for name, weights, size in BLOCK_TYPES.values()}


@dataclass
class BlockFactors:
    """A K-quant's scales and mins as its blocks hold them: small integers per group (per 16 weights for Q6_K) times
    a float16 per block of 256 weights: scales = block_scales (over the block's groups) * group_scales exactly, and
    mins alike (block_mins being -dmin). What the int8 kernels keep: a quarter of float32 scales' and mins' bytes."""

    group_scales: torch.Tensor  # int8 [out, groups or 2 * groups]
    block_scales: torch.Tensor  # float32 [out, in / 256], float16 values
    group_mins: torch.Tensor | None = None  # int8 [out, groups]
    block_mins: torch.Tensor | None = None  # float32 [out, in / 256]


@dataclass
class Groups:
    """One weight [out, in] as `kind`'s groups of 32 along `in`: codes uint8 [out, in/2] (4-bit pairs) or int8
    [out, in] (8-bit); scales float32 [out, in/32], or [out, in/16] for a scale per 16 weights; mins float32
    [out, in/32] or None."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    factors: BlockFactors | None = None  # a K-quant's, from which its scales and mins are made

    @property
    def four_bit(self) -> bool:
        return self.codes.dtype == torch.uint8

    @property
    def halves(self) -> bool:
        """Whether each group has two scales, one per 16 weights (Q6_K)."""
        return self.scales.shape[1] * GROUP == 2 * self.in_features

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * (2 if self.four_bit else 1)

    def integers(self) -> torch.Tensor:
        """The codes as whole numbers [out, in]."""
        if not self.four_bit:
            return self.codes
        packed = self.codes.view(self.codes.shape[0], -1, GROUP // 2)
        return torch.cat([packed & 15, packed >> 4], dim=-1).view(self.codes.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these groups stand for, rounded as gguf's dequantize rounds them."""
        out, width = self.codes.shape[0], self.scales.shape[1]
        q = self.integers().float().view(out, width, -1)
        w = q * self.scales[..., None]
        if self.mins is not None:
            w = w.view(out, self.mins.shape[1], GROUP) + self.mins[..., None]
        return w.reshape(out, -1)


def groups_from_blocks(kind: str, blocks: np.ndarray) -> Groups:
    """GGUF blocks of `kind` [out, bytes a row] (uint8) as Groups (copies, off the file)."""
    rows = blocks.shape[0]
    weights, size = BLOCK_SHAPES[kind]
    raw = np.ascontiguousarray(blocks).reshape(rows, -1, size)
    codes, scales, mins, *factors = _READERS[kind](raw)

    def rows_of(array: np.ndarray | None, dtype=np.float32) -> torch.Tensor | None:
        return None if array is None else torch.from_numpy(np.ascontiguousarray(array.reshape(rows, -1), dtype=dtype))

    block = None if not factors else BlockFactors(
        rows_of(factors[0], np.int8), rows_of(factors[1]), rows_of(factors[2], np.int8), rows_of(factors[3]))
    return Groups(kind, rows_of(codes, codes.dtype), rows_of(scales), rows_of(mins), block)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32."""
    return raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibble_pairs(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Groups of 32 codes 0..15 given as their first and last 16 ([.., 16] each), as GGUF's Q4_1 pairs them."""
    return (low | (high << 4)).astype(np.uint8)


def _read_q4_0(raw):
    d = _halves(raw, 0)
    return raw[..., 2:], d, -8 * d


def _read_q4_1(raw):
    return raw[..., 4:], _halves(raw, 0), _halves(raw, 2)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 [.., 32]: low nibbles of qs for elements 0..15, high ones for 16..31, bit j of the
    32-bit qh the fifth bit of element j."""
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8)


def _read_q5_0(raw):
    return _five_bits(raw[..., 2:6], raw[..., 6:]) - 16, _halves(raw, 0), None


def _read_q5_1(raw):
    return _five_bits(raw[..., 4:8], raw[..., 8:]), _halves(raw, 0), _halves(raw, 2)


def _read_q8_0(raw):
    return raw[..., 2:].view(np.int8), _halves(raw, 0), None


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from their 12 bytes: groups 0..3 in the low 6 bits of bytes 0..3 and
    4..7; groups 4..7 in the nibbles of bytes 8..11, with the top 2 bits in bytes 0..7's high bits."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 63, (third & 15) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 63, (third >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 4-bit parts [.., 8, 32]: group 2i the low nibbles of bytes 32i..32i + 31, group 2i + 1 the high."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 15, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_factors(raw, codes):
    """Q4_K/Q5_K codes with their scales and mins: d * scale_j and -dmin * min_j, and those factors themselves."""
    scales, mins = _k_scales_mins(raw[..., 4:16])
    d, minus_dmin = _halves(raw, 0), -_halves(raw, 2)
    return codes, d[..., None] * scales, minus_dmin[..., None] * mins, scales, d, mins, minus_dmin


def _read_q4_k(raw):
    q = _k_low_nibbles(raw[..., 16:])
    return _k_factors(raw, _nibble_pairs(q[..., :16], q[..., 16:]))


def _read_q5_k(raw):
    high = (raw[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # bit j of byte l: group j's l-th
    return _k_factors(raw, (_k_low_nibbles(raw[..., 48:]) | (high << 4)).astype(np.int8))


def _read_q6_k(raw):
    """Q6_K: in each half of 128 weights, 64 bytes of low nibbles (weights 0..63 low, 64..127 high) and 32 bytes of
    2-bit high parts (four 32-weight runs at shifts 0, 2, 4, 6); 16 int8 scales, one per 16 weights; then d."""
    low = raw[..., :128].reshape(*raw.shape[:-1], 2, 1, 64)
    low = np.concatenate([low & 15, low >> 4], axis=-2).reshape(*raw.shape[:-1], 2, 128)
    high = raw[..., 128:192].reshape(*raw.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (high & 3).reshape(*raw.shape[:-1], 2, 128)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(*raw.shape[:-1], SUPER)
    scales = raw[..., 192:208].view(np.int8).astype(np.float32)
    d = _halves(raw, 208)
    return q, d[..., None] * scales, None, scales, d, None, None


_READERS = {"Q4_0": _read_q4_0, "Q4_1": _read_q4_1, "Q5_0": _read_q5_0, "Q5_1": _read_q5_1, "Q8_0": _read_q8_0,
            "Q4_K": _read_q4_k, "Q5_K": _read_q5_k, "Q6_K": _read_q6_k}


def quantize(weight: torch.Tensor, kind: str) -> Groups:
    """Round a float weight to Q4_1 or Q8_0 groups as llama.cpp's reference quantizer (and gguf-py) does: Q4_1 spans
    each group's min..max in 15 steps, Q8_0 scales its largest magnitude to 127; scales and mins are stored as
    float16."""
    out = weight.shape[0]
    w = weight.detach().float().view(out, -1, GROUP)
    if kind == "Q8_0":
        scales = w.abs().amax(-1, keepdim=True) / 127
        scaled = w * torch.where(scales == 0, 0, 1 / scales)
        whole = scaled.abs().floor()
        q = scaled.sign() * (whole + (2 * (scaled.abs() - whole)).floor())  # halves away from zero
        return Groups(kind, q.to(torch.int8).view(out, -1), scales[..., 0].half().float())
    if kind != "Q4_1":
        raise ValueError(f"the engine quantizes to Q4_1 or Q8_0, not {kind}")
    low = w.amin(-1, keepdim=True)
    scales = (w.amax(-1, keepdim=True) - low) / 15
    q = ((w - low) * torch.where(scales == 0, 0, 1 / scales) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    codes = (q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)).view(out, -1)
    return Groups(kind, codes, scales[..., 0].half().float(), low[..., 0].half().float())
