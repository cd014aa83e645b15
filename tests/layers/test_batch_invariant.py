"""Deterministic mode's layer primitives on this CPU: a linear layer's row (padded rows) and
an activation's row (row tiles) are the same bits whatever the number of rows beside it.
The probe of what varies without them is in tllm.layers.batch_invariant's docstring."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tllm.layers.activation import SiluAndMul
from tllm.layers.batch_invariant import make_batch_invariant
from tllm.layers.invariant_ops import padded_rows
from tllm.layers.linear import Linear

ROW_COUNTS = list(range(1, 40)) + [63, 64, 65, 130]


def _row_results(fn, width: int) -> set[bytes]:
    """fn's result for one fixed row, placed among M - 1 random rows, for every M."""
    torch.manual_seed(0)
    probe = torch.randn(width)
    results = set()
    for rows in ROW_COUNTS:
        x = torch.randn(rows, width)
        at = rows // 2
        x[at] = probe
        results.add(fn(x)[at].numpy().tobytes())
    return results


@pytest.mark.parametrize("in_features,out_features", [(64, 128), (128, 64), (96, 384)])
def test_linear_rows_do_not_depend_on_the_batch(in_features, out_features):
    layer = Linear(in_features, out_features)
    layer.weight.data.normal_()
    model = nn.Sequential(layer)
    make_batch_invariant(model, torch.device("cpu"))
    with torch.inference_mode():
        assert len(_row_results(model, in_features)) == 1


def test_activation_rows_do_not_depend_on_the_batch():
    act = SiluAndMul()
    make_batch_invariant(nn.Sequential(act), torch.device("cpu"))
    assert act.is_row_tiled
    for width in (256, 2 * 1536, 2 * 37):
        assert len(_row_results(act, width)) == 1
        x = torch.randn(5, width)
        gate, up = x.chunk(2, dim=-1)
        assert torch.allclose(act(x), F.silu(gate) * up, rtol=1e-6, atol=1e-7)


def test_padded_rows():
    assert [padded_rows(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    assert padded_rows(3, 40) == 40 and padded_rows(41, 40) == 48


def test_int8_layers_always_take_the_gemm():
    from tllm.kernels.int8_cpu import DEQUANT_MIN_ROWS
    from tllm.layers.batch_invariant import min_rows_of
    layer = nn.Module()
    layer.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int8))
    assert min_rows_of(layer) == max(8, DEQUANT_MIN_ROWS)
    assert min_rows_of(Linear(4, 4)) == 8
