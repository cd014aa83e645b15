"""RMSNorm (with fused residual add) and SiLU-and-mul kernels vs their torch references."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.triton.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from tllm.kernels.triton.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from tllm.layers.activation import SiluAndMul  # noqa: E402
from tllm.layers.norm import RMSNorm  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (2, 3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, dtype, shape, with_residual):
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device) if with_residual else None
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    got = rms_norm(x, weight, 1e-6, residual)
    want = rms_norm_ref(x, weight, 1e-6, residual)
    module = RMSNorm(shape[-1], 1e-6).to(device)
    module.weight.data = weight
    from_module = module(x, residual)
    if with_residual:
        # the new residual is x + residual rounded to the dtype: exact, except that the
        # interpreter truncates fp32 -> bf16 where the GPU rounds
        if device.type == "cuda" or dtype != torch.bfloat16:
            assert torch.equal(got[1], want[1])
        assert relative_error(got[1], want[1]) < TOL[dtype]
        got, want, from_module = got[0], want[0], from_module[0]
    assert got.dtype == dtype and got.shape == x.shape
    assert relative_error(got, want) < TOL[dtype]
    assert relative_error(got, from_module.float()) < TOL[dtype]


def test_rms_norm_strided_rows(device):
    x = torch.randn(5, 2 * 256, device=device)[:, :256]  # rows with a gap between them
    weight = torch.randn(256, device=device)
    assert relative_error(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (9, 2 * 1500), (2, 3, 2 * 512)])
def test_silu_and_mul(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    got = silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert relative_error(got, silu_and_mul_ref(x)) < TOL[dtype]
    assert relative_error(got, SiluAndMul()(x).float()) < TOL[dtype]
