"""oneDNN-packed linear layers: same products as nn.Linear, batch-invariant rows, and lossless decoding through them."""
import pytest
import torch
from torch import nn

from conftest import PACKED_DTYPES, SHAPES, tiny_engine, tokens_of
from engine.model.packed import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5),
                                             pytest.param(torch.bfloat16, 2e-2, marks=PACKED_DTYPES[1].marks)])
def test_packed_linear_computes_what_the_linear_does(bias, dtype, tolerance):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for rows in (1, 3, 24):
        x = torch.randn(2, rows, 96, dtype=dtype)
        torch.testing.assert_close(packed(x), linear(x), rtol=tolerance, atol=tolerance)
    assert packed.weight.dtype == dtype and packed.weight.numel() == 0  # stand-in for dtype/device readers


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("sizes", [(576, 1536), (1536, 576)])
def test_rows_do_not_depend_on_how_many_rows_go_through_together(dtype, sizes):
    """What makes a tree forward agree with one-token decoding: a lone row too (oneDNN's one-row kernel rounds
    differently for 1536 inputs; PackedLinear sends it as two)."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(*sizes, bias=False).to(dtype))
    x = torch.randn(64, sizes[0], dtype=dtype)
    everything = packed(x)
    for rows in (2, 3, 8, 13, 24, 63):
        assert torch.equal(packed(x[:rows]), everything[:rows]), rows
    for i in range(64):
        assert torch.equal(packed(x[i]), everything[i]), i  # a lone 1-D row, as the LM head gets in decoding


def test_pack_linears_replaces_plain_cpu_linears_only():
    class Quantized(nn.Linear):  # stands for bitsandbytes' nn.Linear subclasses
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), Quantized(8, 8)), nn.Linear(8, 8).half())
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model.modules() if not isinstance(m, nn.Sequential)] == [
        "PackedLinear", "PackedLinear", "Quantized", "Linear"
    ]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_engine_greedy_equals_vanilla(shape, kind, dtype, prompt):
    """bfloat16 too: the packed CPU engine computes every row alike whatever the batch (engine.model.attention)."""
    engine = tiny_engine(shape, kind, pack=True, dtype=dtype)
    assert not any(type(m) is nn.Linear for m in engine.model.modules())
    assert engine.batch_invariant
    if kind == "eagle1":  # packed after the head borrowed it, the base LM head is still the one it drafts through
        assert isinstance(engine.head.base_lm_head(), PackedLinear)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=80))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=80))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0
    if dtype == torch.float32:  # bf16 rounds differently without packing: only float32 is comparable across kernels
        unpacked = tiny_engine(shape, None)  # same seeds: the model before packing
        assert tokens_of(unpacked.generate(prompt, method="vanilla", max_new_tokens=80)) == vanilla
