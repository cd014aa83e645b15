"""RMSNorm (+ residual) -> FP8 and SiLU-and-mul -> FP8 kernels: against their float32
references (quantized per token), and against the unfused kernels followed by the
per-token quantization kernel, which they must equal."""
import pytest
import torch

from tests.kernels.test_fp8_quant import assert_same_fp8, assert_same_scale

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import fp8  # noqa: E402
from tllm.kernels.triton import fp8_quant  # noqa: E402
from tllm.kernels.triton.activation import (silu_and_mul, silu_and_mul_quant,  # noqa: E402
                                            silu_and_mul_quant_ref, silu_and_mul_ref)
from tllm.kernels.triton.rmsnorm import (rms_norm, rms_norm_quant, rms_norm_quant_ref,  # noqa: E402
                                         rms_norm_ref)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# e4m3 keeps 3 mantissa bits: each value is off by at most half a step, 2^-4 of itself
FP8_TOL = 2.0 ** -4


def scale_tol(dtype) -> float:
    """The scale is the amax of values rounded twice to the dtype (the norm, then times the
    weight), each rounding under one ulp (the interpreter truncates): < 2 eps of the dtype."""
    return 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


def check_quantized(got: fp8.QuantizedActivation, want: fp8.QuantizedActivation,
                    exact: torch.Tensor, dtype) -> None:
    """`want` is the float32 reference quantized, `exact` the float32 reference before it.
    The kernels round to the activation dtype before quantizing (as the unfused path does),
    which moves the amax by a rounding and some values across an fp8 rounding boundary."""
    assert got.q.dtype == fp8.FP8_DTYPE and got.q.shape == want.q.shape
    assert got.scale.shape == (*got.q.shape[:-1], 1) and got.dtype == dtype
    assert relative_error(got.scale, want.scale) < scale_tol(dtype)
    err = relative_error(got.q.float() * got.scale, exact)
    assert err < FP8_TOL, err


def check_same_as_unfused(got: fp8.QuantizedActivation, unfused: torch.Tensor) -> None:
    """Byte for byte under the interpreter; on CUDA the fused kernel's amax / 448 may round
    an ulp apart from the quantization kernel's (seen on the H200: one scale of 6), and a
    value then one e4m3 step (as tests/kernels/test_fp8_quant.py allows)."""
    q, scale = fp8_quant.quantize_per_token(unfused)
    assert_same_scale(got.scale, scale)
    assert_same_fp8(got.q, q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (2, 3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant(device, dtype, shape, with_residual):
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device) if with_residual else None
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    got = rms_norm_quant(x, weight, 1e-6, residual)
    want = rms_norm_quant_ref(x, weight, 1e-6, residual)
    exact = rms_norm_ref(x, weight, 1e-6, residual)
    unfused = rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], unfused[1])  # the same kernel computes the new residual
        got, want, exact, unfused = got[0], want[0], exact[0], unfused[0]
    check_quantized(got, want, exact, dtype)
    check_same_as_unfused(got, unfused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (9, 2 * 1500), (2, 3, 2 * 512),
                                   (3, 2 * 5000)])  # the last loops over chunks
def test_silu_and_mul_quant(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    got = silu_and_mul_quant(x)
    check_quantized(got, silu_and_mul_quant_ref(x), silu_and_mul_ref(x), dtype)
    check_same_as_unfused(got, silu_and_mul(x))


def test_silu_and_mul_quant_rejects_odd_width(device):
    with pytest.raises(ValueError, match="odd"):
        silu_and_mul_quant(torch.randn(2, 7, device=device))
