"""Linear layers with their weights packed once for oneDNN, for inference on the CPU.

A plain `nn.Linear` on the CPU re-lays its weight out for the matmul kernel on every call. For a small model that
is memory-bound per token, this costs as much as the matmul itself: packing once makes a one-token forward much
cheaper and a forward over a few dozen tree tokens cost little more than one token.
The packed layer computes the same products in the same order for every batch of two or more rows. For some shapes
oneDNN gives a lone row (one-token decoding) another kernel that sums in another order; such a row goes through as
two. Every row thus comes out the same bits whatever the batch, and a tree forward agrees with one-token decoding
(see engine.model.attention).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

PACK_BATCH_HINT = 16  # oneDNN picks its weight layout for this many rows; measured fine for 1..64 rows


def packing_available() -> bool:
    """True when this torch build has the oneDNN linear ops (x86 CPU builds do)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


def bf16_native() -> bool:
    """True on CPUs that multiply bfloat16 natively (AVX-512 BF16, AMX), where a packed bf16 layer reads half the
    bytes of a float32 one and runs about as fast per byte."""
    return packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """Inference-only stand-in for an nn.Linear on the CPU, holding the weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        measure_lone_rows(  # now, at load, for every thread count the engine may switch to (engine.model.threads)
            self.in_features, self.out_features, linear.weight.dtype, self.bias is not None,
            range(1, torch.get_num_threads() + 1),
        )
        # An empty stand-in: code that asks a layer for its weight's dtype or device keeps working.
        self.register_buffer("weight", linear.weight.new_empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features and lone_row_sums_differently(
            self.in_features, self.out_features, self.weight.dtype, self.bias is not None, torch.get_num_threads()
        ):
            pair = x.reshape(1, -1).expand(2, -1).contiguous()  # as two rows, for the kernel every batch gets
            return _multiply(pair, self.packed, self.bias)[:1].view(*x.shape[:-1], self.out_features)
        return _multiply(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _multiply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_LONE_ROWS: dict[tuple[int, int, torch.dtype, bool, int], bool] = {}  # (shape, dtype, bias, threads) -> measured


def lone_row_sums_differently(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool, threads: int
) -> bool:
    """Whether oneDNN multiplies a single row in another order than a batch, for this shape, dtype and thread count
    (measured by measure_lone_rows, once per key)."""
    key = (in_features, out_features, dtype, bias, threads)
    if key not in _LONE_ROWS:
        measure_lone_rows(in_features, out_features, dtype, bias, (threads,))
    return _LONE_ROWS[key]


def measure_lone_rows(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool, thread_counts: Iterable[int]
) -> None:
    """Measure lone_row_sums_differently's answer for each thread count not measured yet.

    On weights of +-1 and inputs of +-2^k spread over 24 octaves the products are exact and their sums cancel, so
    any change of summation order shows in the result, in bfloat16 outputs too. Padding every lone row instead would
    cost ~10 % of a float32 step, where most shapes need none. One measurement takes a few hundred ms for an LM head
    (most of it making the test weight), so every thread count shares one weight, and the engine measures them all
    at load: measured in the first step after a thread-count change, it made that step many times slower (and the
    meter's plain-step timing with it).
    """
    counts = [t for t in thread_counts if (in_features, out_features, dtype, bias, t) not in _LONE_ROWS]
    if not counts:
        return
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).sign().to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    bias_row = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    rows = max(2, min(256, 2**17 // out_features))
    octaves = torch.randint(-12, 13, (rows, in_features), generator=generator).to(torch.float32)
    x = (torch.randn(rows, in_features, generator=generator).sign() * 2.0**octaves).to(dtype)
    before = torch.get_num_threads()
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            together = _multiply(x, packed, bias_row)
            _LONE_ROWS[in_features, out_features, dtype, bias, threads] = any(
                not torch.equal(_multiply(x[i : i + 1], packed, bias_row), together[i : i + 1]) for i in range(rows)
            )
    finally:
        torch.set_num_threads(before)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN can pack here: float32 on any x86 build, bfloat16 only where the CPU has bf16 support
    (oneDNN refuses to reorder a bf16 weight on an AVX2-only CPU)."""
    if not packing_available():
        return ()
    return (torch.float32, torch.bfloat16) if bf16_native() else (torch.float32,)


def pack_linears(model: nn.Module) -> int:
    """Replace every plain CPU nn.Linear of a packable dtype in `model` by a PackedLinear; returns how many.

    Subclasses (bitsandbytes' quantized layers among them), layers on other devices and layers of other dtypes
    are left alone.
    """
    dtypes = packable_dtypes()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and child.weight.dtype in dtypes
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
