"""Weight-only int4/int8 GEMM kernels vs the float32 torch reference (tllm.kernels.woq): the
M = 1 GEMV (fp32 math; the packed 16-bit PTX math on the GPU only), the "wx" dot kernel
(weight tile as the left operand) and the first "xw" one, with and without split-K, the
dequantize kernel; random weights with asymmetric zeros, several M/N/K/group sizes, 4 and 8
bits; every config the benchmark sweeps."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import woq  # noqa: E402
from tllm.kernels.triton.w4a16_gemm import (WoqConfig, default_config,  # noqa: E402
                                            sweep_configs, woq_dequantize, woq_mm)
from tllm.kernels.triton.w4a16_gemv import split_counters  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def packed_weight(n, k, bits, group, device, scale_dtype=torch.float32):
    """Random values, random zero points anywhere in the range, random positive scales."""
    layout = woq.WoqLayout(bits, group, woq.interleave_words(k, bits))
    top = 2 ** bits
    q = torch.randint(0, top, (n, k), dtype=torch.int32)
    scales = (torch.rand(k // group, n) * 0.02 + 0.001).to(scale_dtype)
    zeros = torch.randint(0, top, (k // group, n)).to(scale_dtype)
    qweight = woq.pack_rows(q, layout)
    return [t.to(device) for t in (qweight, scales, zeros)], layout, q


@pytest.mark.parametrize("bits,k", [(4, 256), (4, 64), (4, 48), (8, 64), (8, 96)])
def test_pack_roundtrip_and_dequantize_formula(bits, k):
    (qweight, scales, zeros), layout, q = packed_weight(8, k, bits, 16, "cpu")
    assert qweight.shape == (8, k * bits // 32)
    assert torch.equal(woq.unpack_rows(qweight, layout), q)
    w = woq.dequantize(qweight, scales, zeros, layout)
    n, col = 5, 37
    assert w[n, col] == (q[n, col] - zeros[col // 16, n]) * scales[col // 16, n]


def test_interleaved_word_layout():
    """In a chunk of 16 words, bit-field j of word w holds value j * 16 + w of the chunk."""
    layout = woq.WoqLayout(4, 128, 16)
    q = torch.randint(0, 16, (2, 256))
    words = woq.pack_rows(q, layout)
    chunk, w, j = 1, 5, 6
    value = (int(words[1, chunk * 16 + w]) >> (4 * j)) & 15
    assert value == q[1, chunk * 128 + j * 16 + w]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 256, 64), (1, 40, 128, 128),
                                         (1, 24, 192, 192), (3, 64, 256, 32),
                                         (16, 48, 128, 128), (2, 32, 64, 64)])
def test_default_configs(device, bits, dtype, m, n, k, group):
    (qweight, scales, zeros), layout, _ = packed_weight(n, k, bits, group, device, torch.float16)
    x = torch.randn(m, k, device=device).to(dtype)
    out = woq_mm(x, qweight, scales, zeros, layout)
    assert out.shape == (m, n) and out.dtype == dtype
    err = relative_error(out, woq.woq_mm_ref(x, qweight, scales, zeros, layout))
    assert err < TOL[dtype], err


@pytest.mark.parametrize("cfg", [WoqConfig(1, 16, split_k=3), WoqConfig(1, 32, 2),
                                 WoqConfig(1, 8, 2, kind="gemv", chunks=2),
                                 WoqConfig(1, 4, 1, kind="gemv", chunks=4),
                                 WoqConfig(16, 32, split_k=4), WoqConfig(32, 16, 2),
                                 WoqConfig(16, 32, split_k=4, kind="xw")])
@pytest.mark.parametrize("group", [64, 384])
def test_split_k(device, cfg, group):
    # uneven splits of the K tiles; N not a multiple of the tile; groups shorter than a
    # chunk (64) and longer (384); the split counters are left zero for the next launch
    m = 1 if cfg.block_m == 1 else 5
    n, k = 40, 384
    (qweight, scales, zeros), layout, _ = packed_weight(n, k, 4, group, device)
    for _ in range(2):
        x = torch.randn(m, k, device=device)
        out = woq_mm(x, qweight, scales, zeros, layout, config=cfg)
        assert relative_error(out, woq.woq_mm_ref(x, qweight, scales, zeros, layout)) < 1e-5
    assert not split_counters(torch.device(device), 64)[:64].any()


def test_split_sum_is_deterministic(device):
    (qweight, scales, zeros), layout, _ = packed_weight(24, 512, 4, 128, device)
    x = torch.randn(1, 512, device=device)
    cfg = WoqConfig(1, 8, split_k=4, kind="gemv")
    first = woq_mm(x, qweight, scales, zeros, layout, config=cfg)
    assert torch.equal(first, woq_mm(x, qweight, scales, zeros, layout, config=cfg))


@pytest.mark.parametrize("cfg", sweep_configs(1) + sweep_configs(16) + sweep_configs(64)
                         + sweep_configs(256), ids=lambda c: c.label().replace(" ", "-"))
def test_benchmark_sweep_configs(device, cfg):
    # every launch the benchmark times is correct (smaller shapes, same constexprs)
    gemv = cfg.resolved_kind == "gemv"
    m, n, k = (1, 24, 128 * cfg.chunks) if gemv else (5, 24, 256)
    (qweight, scales, zeros), layout, _ = packed_weight(n, k, 4, 128, device, torch.float16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = woq_mm(x, qweight, scales, zeros, layout, config=cfg)
    assert relative_error(out, woq.woq_mm_ref(x, qweight, scales, zeros, layout)) < 1e-2


def test_tiled_path_grouped_order(device):
    # several M and N tiles, GROUP_M smaller than the M tiles: the grouped program order
    m, n, k, group = 70, 80, 128, 32
    (qweight, scales, zeros), layout, _ = packed_weight(n, k, 4, group, device, torch.float16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = woq_mm(x, qweight, scales, zeros, layout, config=WoqConfig(32, 32, group_m=2))
    assert relative_error(out, woq.woq_mm_ref(x, qweight, scales, zeros, layout)) < 1e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_kernel(device, bits):
    (qweight, scales, zeros), layout, _ = packed_weight(72, 256, bits, 128, device)
    w = woq_dequantize(qweight, scales, zeros, layout, torch.float32)
    assert torch.equal(w.cpu(), woq.dequantize(qweight, scales, zeros, layout).cpu())


def test_config_choice():
    cpu = torch.device("cpu")  # counts as 8 SMs
    layout = woq.WoqLayout(4, 128, 16)
    wide = default_config(1, 4096, 4096, layout, cpu)   # 256 programs of 16 rows
    assert wide.kind == "gemv" and wide.block_n == 16 and wide.chunks == 8
    assert wide.num_warps == 2 and wide.split_k == 1 and wide.packed
    middle = default_config(1, 160, 14336, layout, cpu)  # 10 of 16 rows: 8 rows a program
    assert middle.block_n == 8 and middle.chunks == 16 and middle.split_k == 1  # 112 chunks
    narrow = default_config(1, 32, 4096, layout, cpu)
    assert narrow.split_k > 1
    small = default_config(8, 4096, 4096, layout, cpu)
    assert small.kind == "wx" and small.block_m == 16 and small.num_warps == 8
    assert default_config(40, 4096, 4096, layout, cpu).block_m == 64
    assert default_config(100, 4096, 4096, layout, cpu).block_m == 128
    assert default_config(128, 4096, 4096, layout, cpu).kind == "dequant"


def test_narrow_chunks_take_the_dequantized_path(device):
    # K = 64 at 8 bits packs in chunks of 16 words; K = 96 at 4 bits in chunks of 4 words:
    # M > 1 then dequantizes (the dot kernel needs 16-deep fields), M = 1 runs the GEMV
    (qweight, scales, zeros), layout, _ = packed_weight(32, 96, 4, 32, device)
    assert layout.chunk_words == 4
    for m in (1, 3):
        x = torch.randn(m, 96, device=device)
        out = woq_mm(x, qweight, scales, zeros, layout)
        assert relative_error(out, woq.woq_mm_ref(x, qweight, scales, zeros, layout)) < 1e-5


def test_bad_shapes_are_refused(device):
    (qweight, scales, zeros), layout, _ = packed_weight(32, 128, 4, 32, device)
    with pytest.raises(ValueError, match="do not multiply"):
        woq_mm(torch.randn(1, 64, device=device), qweight, scales, zeros, layout)
    with pytest.raises(ValueError, match="takes one row"):
        woq_mm(torch.randn(2, 128, device=device), qweight, scales, zeros, layout,
               config=WoqConfig(1, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed PTX math runs on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(100, 4096, 128), (64, 14336, 128), (40, 384, 384),
                                       (24, 256, 64)])
def test_packed_gemv_on_gpu(dtype, n, k, group):
    # group 64: shorter than a chunk, the fp32 math; the others the packed 16-bit PTX
    (qweight, scales, zeros), layout, _ = packed_weight(n, k, 4, group, "cuda", torch.float16)
    x = torch.randn(1, k, device="cuda").to(dtype)
    ref = woq.woq_mm_ref(x, qweight, scales, zeros, layout)
    for cfg in (None, WoqConfig(1, 16, 3, kind="gemv", chunks=2),
                WoqConfig(1, 8, 1, kind="gemv", chunks=32, packed=False)):
        out = woq_mm(x, qweight, scales, zeros, layout, config=cfg)
        assert relative_error(out, ref) < 1e-2, cfg
