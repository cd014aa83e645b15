"""The CPU int8-weight products (tllm.kernels.int8_cpu) against their float64 reference on
fresh random inputs: the GEMV kernel below DEQUANT_MIN_ROWS rows, the widened bf16 GEMM from
there on (the LM head's shape in slices), both in bf16 and in float32."""
from __future__ import annotations

import pytest
import torch

from tllm.kernels import int8_cpu
from tllm.kernels.int8_cpu import DEQUANT_MIN_ROWS, int8_matmul, int8_matmul_ref
from tllm.layers.quant.gguf import quantize_rows_int8


def weight(n: int, k: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_rows_int8(torch.randn(n, k, generator=g) * 0.05)
    return q, scale.to(dtype)


@pytest.mark.parametrize("rows", [1, DEQUANT_MIN_ROWS - 1, DEQUANT_MIN_ROWS, 40])
@pytest.mark.parametrize("n,k", [(64, 128), (96, 576), (48, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_product_matches_reference(rows, n, k, dtype):
    q, scale = weight(n, k, seed=rows * 7 + n, dtype=dtype)
    g = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=g) * 3
    out = int8_matmul(x, q, scale)
    assert out.dtype == x.dtype and out.shape == (rows, n)
    ref = int8_matmul_ref(x, q, scale)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


def test_weight_in_slices(monkeypatch):
    """A weight larger than the scratch buffer (as the LM head is) goes through in slices,
    the last one short."""
    monkeypatch.setattr(int8_cpu, "_SCRATCH_ELEMENTS", 10 * 64)
    q, scale = weight(45, 64, seed=5, dtype=torch.float32)
    x = torch.randn(DEQUANT_MIN_ROWS + 3, 64)
    ref = int8_matmul_ref(x, q, scale)
    assert (int8_matmul(x, q, scale).double() - ref).norm() / ref.norm() < 1e-5


def test_paths_agree_on_a_row():
    """A row's result barely depends on the batch: the GEMV alone vs the widened GEMM."""
    q, scale = weight(96, 576, seed=6, dtype=torch.bfloat16)
    x = torch.randn(DEQUANT_MIN_ROWS, 576)
    alone = int8_matmul(x[:1], q, scale)
    batched = int8_matmul(x, q, scale)[:1]
    assert (alone - batched).norm() / alone.norm() < 1e-2


def test_leading_dims_and_dtype_kept():
    q, scale = weight(32, 64, seed=3, dtype=torch.bfloat16)
    for rows in (1, DEQUANT_MIN_ROWS):
        x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
        out = int8_matmul(x, q, scale)
        assert out.shape == (2, rows, 32) and out.dtype == torch.bfloat16
