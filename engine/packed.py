"""Linear layers with their weights packed once for oneDNN, for inference on the CPU.

A plain `nn.Linear` on the CPU re-lays its weight out for the matmul kernel on every call. For a small model that
is memory-bound per token, this costs as much as the matmul itself: packing once halves a one-token forward and
makes a forward over a few dozen tree tokens cost little more than one token (measured in README, "CPU kernels").
The packed layer computes the same products in the same order for every batch of two or more rows, so a tree
forward and the same tokens fed in a larger batch agree bit for bit; a one-row product may differ in the last bit,
as it already does for `nn.Linear`.
"""
from __future__ import annotations

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
        # An empty stand-in: code that asks a layer for its weight's dtype or device keeps working.
        self.register_buffer("weight", linear.weight.new_empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every plain CPU float32/bfloat16 nn.Linear in `model` by a PackedLinear; returns how many.

    Subclasses (bitsandbytes' quantized layers among them) and layers on other devices are left alone.
    """
    if not packing_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and child.weight.dtype in (torch.float32, torch.bfloat16)
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
