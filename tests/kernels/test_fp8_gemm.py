"""FP8 GEMM kernels vs their float32 torch references: the small-M weight-only kernel
(per-channel and block scales, with and without split-K) and the W8A8 tiled kernel
(per-token x per-channel, and per-token-group x block)."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import fp8 as ref  # noqa: E402
from tllm.kernels.triton.fp8_gemm import (MmConfig, SmallMConfig, fp8_mm,  # noqa: E402
                                          small_m_config, w8a16_mm)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# fp8 x fp8 on Hopper's tensor cores: ~14 bits while a K tile accumulates, whatever the output
W8A8_TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CUDA = torch.cuda.is_available()


def fp8_weight(n, k, device, block=None):
    w = torch.randn(n, k, device=device) * 0.05
    return ref.quantize_blocks(w, block) if block else ref.quantize_per_channel(w)


def poisoned_rows(out):
    """The output buffers are fresh; NaN in any element fails relative_error."""
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 200, 320), (16, 64, 1000)])
def test_w8a16_per_channel(device, dtype, m, n, k):
    x = torch.randn(m, k, device=device).to(dtype)
    wq, ws = fp8_weight(n, k, device)
    out = w8a16_mm(x, wq, ws)
    assert out.shape == (m, n) and out.dtype == dtype
    poisoned_rows(out)
    err = relative_error(out, ref.w8a16_mm_ref(x.float(), wq, ws))
    assert err < TOL[dtype], err


@pytest.mark.parametrize("block_m", [1, 16])  # 1: the GEMV kernel
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_w8a16_block_scales(device, block_m, split_k, block):
    m, n, k = (1 if block_m == 1 else 3), 200, 512
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    wq, ws = fp8_weight(n, k, device, block)
    cfg = SmallMConfig(block_m, 32, min(64, block[1]), split_k)
    out = w8a16_mm(x, wq, ws, block, config=cfg)
    err = relative_error(out, ref.w8a16_mm_ref(x.float(), wq, ws, block))
    assert err < 1e-2, err


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("split_k", [2, 5])
def test_w8a16_split_k(device, m, split_k):
    # uneven splits over K tiles, K not a multiple of the tile
    n, k = 48, 1100
    x = torch.randn(m, k, device=device)
    wq, ws = fp8_weight(n, k, device)
    out = w8a16_mm(x, wq, ws, config=SmallMConfig(1 if m == 1 else 16, 16, 64, split_k))
    assert relative_error(out, ref.w8a16_mm_ref(x, wq, ws)) < 1e-5


def test_w8a16_default_config_splits_narrow_layers():
    cpu = torch.device("cpu")  # counts as 8 SMs
    assert small_m_config(1, 4096, 4096, cpu).split_k == 1
    assert small_m_config(1, 4096, 4096, cpu).block_m == 1      # the GEMV kernel
    narrow = small_m_config(1, 32, 4096, cpu)
    assert narrow.block_n == 16 and narrow.split_k > 1
    assert small_m_config(1, 4096, 4096, cpu, scale_block_k=128).block_k == 128
    assert small_m_config(2, 4096, 4096, cpu).block_m == 16
    assert small_m_config(20, 4096, 4096, cpu).block_m == 32


def test_w8a16_strided_activation_rows(device):
    x = torch.randn(4, 2 * 256, device=device)[:, :256]
    wq, ws = fp8_weight(64, 256, device)
    assert relative_error(w8a16_mm(x, wq, ws), ref.w8a16_mm_ref(x, wq, ws)) < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(70, 96, 256), (3, 130, 200)])
def test_fp8_mm_rowwise(device, out_dtype, m, n, k):
    x = torch.randn(m, k, device=device)
    xq, xs = ref.quantize_per_token(x)
    wq, ws = fp8_weight(n, k, device)
    cfg = MmConfig(32, 32, 64, group_m=2, num_warps=4, num_stages=2)
    out = fp8_mm(xq, xs, wq, ws, out_dtype, config=cfg)
    assert out.shape == (m, n) and out.dtype == out_dtype
    want = ref.scaled_mm_ref(xq, xs, wq, ws, torch.float32)
    err = relative_error(out, want)
    assert err < W8A8_TOL[out_dtype], err


@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
@pytest.mark.parametrize("m,n,k", [(40, 160, 256), (5, 100, 320)])
def test_fp8_mm_block_scales(device, block, m, n, k):
    x = torch.randn(m, k, device=device)
    xq, xs = ref.quantize_per_token_group(x, block[1])
    wq, ws = fp8_weight(n, k, device, block)
    cfg = MmConfig(32, 32, 128, group_m=2, num_warps=4, num_stages=2)
    out = fp8_mm(xq, xs, wq, ws, torch.bfloat16, block, config=cfg)
    want = ref.block_scaled_mm_ref(xq, xs, wq, ws, block, torch.float32)
    err = relative_error(out, want)
    assert err < 1e-2, err


def test_rejects_bad_inputs(device):
    x = torch.randn(2, 64, device=device)
    wq, ws = fp8_weight(32, 64, device)
    with pytest.raises(ValueError, match="do not multiply"):
        w8a16_mm(x[:, :32], wq, ws)
    with pytest.raises(ValueError, match="power of two"):
        w8a16_mm(x, wq, ws, block=(32, 48))
    with pytest.raises(ValueError, match="float8"):
        w8a16_mm(x, wq.float(), ws)


@pytest.mark.skipif(not CUDA, reason="model-sized shapes run on the GPU only")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama_shapes_on_gpu(device, n, k):
    wq, ws = fp8_weight(n, k, device)
    wq_b, ws_b = fp8_weight(n, k, device, (128, 128))
    for m in (1, 8, 32):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        assert relative_error(w8a16_mm(x, wq, ws), ref.w8a16_mm_ref(x.float(), wq, ws)) < 1e-2
        got = w8a16_mm(x, wq_b, ws_b, (128, 128))
        assert relative_error(got, ref.w8a16_mm_ref(x.float(), wq_b, ws_b, (128, 128))) < 1e-2
    for m in (33, 256, 1000):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        xq, xs = ref.quantize_per_token(x)
        got = fp8_mm(xq, xs, wq, ws, torch.bfloat16)
        assert relative_error(got, ref.scaled_mm_ref(xq, xs, wq, ws, torch.float32)) < 1e-2
        xq, xs = ref.quantize_per_token_group(x, 128)
        got = fp8_mm(xq, xs, wq_b, ws_b, torch.bfloat16, (128, 128))
        want = ref.block_scaled_mm_ref(xq, xs, wq_b, ws_b, (128, 128), torch.float32)
        assert relative_error(got, want) < 1e-2
