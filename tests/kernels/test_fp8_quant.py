"""FP8 activation quantization kernels (per token, static, per token group) vs the torch
references of tllm.kernels.fp8: the same scales and the same bytes (on CUDA, up to torch's
reciprocal rounding of a scalar division: see assert_same_fp8)."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.kernels import fp8 as ref  # noqa: E402
from tllm.kernels.triton import fp8_quant  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_rows(shape, dtype, device):
    """Rows whose magnitudes differ by orders of magnitude, so each row's scale matters."""
    rows = torch.randn(shape, device=device) * torch.logspace(-3, 2, shape[0],
                                                              device=device)[:, None]
    return rows.to(dtype)


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Byte for byte under the interpreter. On CUDA, torch divides by a Python-number divisor
    (the references' amax / 448) as a multiply by its reciprocal, one rounding more than the
    kernels' IEEE division: a scale may be an ulp off, and a value then one e4m3 step."""
    assert got.dtype == ref.FP8_DTYPE and got.shape == want.shape
    if not got.is_cuda:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    g, w = got.float(), want.float()
    diff = (g - w).abs()
    assert (diff <= ref.e4m3_spacing(torch.maximum(g.abs(), w.abs()))).all()
    assert (diff > 0).float().mean() < 0.01


def assert_same_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    if got.is_cuda:  # see assert_same_fp8
        torch.testing.assert_close(got, want, rtol=2.0 ** -22, atol=0.0)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (5, 1000), (2, 4096 + 300)])  # the last loops
def test_per_token(device, dtype, shape):
    x = random_rows(shape, dtype, device)
    q, scale = fp8_quant.quantize_per_token(x)
    q_ref, scale_ref = ref.quantize_per_token(x)
    assert scale.shape == (shape[0], 1) and scale.dtype == torch.float32
    assert_same_scale(scale, scale_ref)
    assert_same_fp8(q, q_ref)


def test_per_token_strided_rows_and_zero_row(device):
    x = torch.randn(4, 2 * 96, device=device)[:, :96]
    x[2] = 0.0  # an all-zero row: a finite scale, zeros out
    q, scale = fp8_quant.quantize_per_token(x)
    q_ref, scale_ref = ref.quantize_per_token(x)
    assert_same_scale(scale, scale_ref)
    assert float(scale[2]) > 0
    assert_same_fp8(q, q_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_static(device, dtype):
    x = random_rows((6, 1500), dtype, device)
    scale = torch.tensor([0.37], device=device)  # clips the largest rows: saturation
    q = fp8_quant.quantize_static(x, scale)
    assert_same_fp8(q, ref.quantize_static(x, scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,group", [(256, 128), (1000, 64), (96, 128), (4096, 128)])
def test_per_token_group(device, dtype, k, group):
    x = random_rows((3, k), dtype, device)
    q, scale = fp8_quant.quantize_per_token_group(x, group)
    q_ref, scale_ref = ref.quantize_per_token_group(x, group)
    assert_same_scale(scale, scale_ref)
    assert_same_fp8(q, q_ref)


def test_group_must_be_a_power_of_two(device):
    with pytest.raises(ValueError, match="power-of-two"):
        fp8_quant.quantize_per_token_group(torch.randn(2, 96, device=device), 96)
