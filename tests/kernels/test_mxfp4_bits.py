"""The MXFP4 experts kernel's dequantization from bits (integer ops) against the reference
decoder, over every e2m1 code and a spread of E8M0 scales; tl.dot_scaled's variant and the
MXFP4 tile table on the whole experts call."""
import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402
from tllm.kernels.swiglu_moe import swiglu_experts_ref  # noqa: E402
from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig  # noqa: E402
from tllm.kernels.triton.mxfp4_dots import _e2m1_times_scale, _scale_bits  # noqa: E402
from tllm.kernels.triton.swiglu_moe import mxfp4_moe_config, swiglu_experts_triton  # noqa: E402

# exact over the scale bytes 2 .. 252: checkpoints' range (GPT-OSS: about 100-130) and more
EXACT_SCALES = (2, 3, 64, 100, 119, 120, 122, 126, 127, 128, 130, 160, 200, 250, 252)
# scale bytes 0 and 1 would underflow (code 1 times 2^-127 or 2^-126 is a float32 subnormal
# for ldexp): the bit path flushes such a block to +-0, all of it (every value < 2^-123)
UNDERFLOW_SCALES = (0, 1)
# 253 .. 255 (2^126 and up; 255 is E8M0's NaN) saturate at 252's values (ldexp: up to inf)
SATURATED_SCALES = (253, 254, 255)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@triton.jit
def _dequantize_kernel(out_ptr, words_ptr, scales_ptr, n, SHIFT: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    words = tl.load(words_ptr + offs, mask=mask, other=0)
    exponent_bits, code_mask = _scale_bits(tl.load(scales_ptr + offs, mask=mask, other=127))
    tl.store(out_ptr + offs, _e2m1_times_scale(words, SHIFT, exponent_bits, code_mask),
             mask=mask)


def bit_path(device, codes: torch.Tensor, scales: torch.Tensor, nibble: int) -> torch.Tensor:
    """float32 values of codes [n] (uint8, 0..15) at scales [n] by the kernel's helpers, each
    code at `nibble` of an int32 word whose other nibbles are random."""
    g = torch.Generator().manual_seed(nibble)
    noise = torch.randint(-2 ** 31, 2 ** 31, codes.shape, dtype=torch.int64, generator=g)
    words = (noise & ~(15 << 4 * nibble)) | (codes.long() << 4 * nibble)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=device)
    _dequantize_kernel[(triton.cdiv(codes.numel(), 256),)](
        out, words.to(device), scales.to(device), codes.numel(), SHIFT=4 * nibble, BLOCK=256)
    return out.cpu()


def reference(codes: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """dequantize_mxfp4 of one code per block (the rest of the block zero)."""
    blocks = torch.zeros(codes.numel(), 1, 16, dtype=torch.uint8)
    blocks[:, 0, 0] = codes
    return dequantize_mxfp4(blocks, scales.reshape(-1, 1), dtype)[:, 0]


def all_codes_at(scales) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.arange(16, dtype=torch.uint8).repeat(len(scales))
    return codes, torch.tensor(scales, dtype=torch.uint8).repeat_interleave(16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16  # -0.0 and inf alike
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bits_equal_the_reference_decoder(device, dtype):
    codes, scales = all_codes_at(EXACT_SCALES)
    ref = reference(codes, scales, dtype)
    for nibble in range(8):
        assert same_bits(bit_path(device, codes, scales, nibble).to(dtype), ref), nibble


def test_out_of_range_scales_flush_or_saturate(device):
    codes, scales = all_codes_at(UNDERFLOW_SCALES)
    ours, ref = bit_path(device, codes, scales, 3), reference(codes, scales, torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    assert ((ref != 0) & (ref.abs() < tiny)).any()         # ldexp keeps subnormals there
    assert torch.equal(ours, torch.zeros(len(codes)))      # +-0: the block flushed
    assert torch.equal(torch.signbit(ours), torch.signbit(ref))
    codes, scales = all_codes_at(SATURATED_SCALES)
    ours = bit_path(device, codes, scales, 5)
    assert torch.isinf(reference(codes, scales, torch.float32)).any()
    assert same_bits(ours, reference(codes, torch.full_like(scales, 252), torch.float32))


def experts_case(num_tokens: int, dtype, seed: int = 0):
    """Random MXFP4 experts (4 of them, H = I = 64), a routing and the float32 reference."""
    g = torch.Generator().manual_seed(seed)
    hidden_size = inter = 64
    w13 = torch.randint(0, 256, (4, 2 * inter, hidden_size // 32, 16), dtype=torch.uint8,
                        generator=g)
    w2 = torch.randint(0, 256, (4, hidden_size, inter // 32, 16), dtype=torch.uint8,
                       generator=g)
    s13 = torch.randint(120, 124, w13.shape[:-1], dtype=torch.uint8, generator=g)
    s2 = torch.randint(120, 124, w2.shape[:-1], dtype=torch.uint8, generator=g)
    b13 = torch.randn(4, 2 * inter, generator=g).to(dtype)
    b2 = torch.randn(4, hidden_size, generator=g).to(dtype)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
    values, ids = torch.randn(num_tokens, 4, generator=g).topk(2, -1)
    weights = values.softmax(-1)
    ref = swiglu_experts_ref(hidden.float(), lambda e: (
        dequantize_mxfp4(w13[e], s13[e]), b13[e].float(), dequantize_mxfp4(w2[e], s2[e]),
        b2[e].float()), 4, weights, ids, 1.702, 7.0)
    return (hidden, w13, b13, w2, b2, weights, ids), (s13, s2), ref


@pytest.mark.parametrize("mxfp4_dot", ["bits", "scaled"])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_default_tiles_and_both_dots_match_reference(device, mxfp4_dot, num_tokens):
    """config None: mxfp4_moe_config's decode tiles (BLOCK_K 256 over K 64: one masked step;
    at one token block_m 1, the GEMV, for "bits", 16 for "scaled")."""
    args, (s13, s2), ref = experts_case(num_tokens, torch.bfloat16)
    args = [t.to(device) for t in args]
    out = swiglu_experts_triton(*args[:7], 1.702, 7.0, w13_scales=s13.to(device),
                                w2_scales=s2.to(device), mxfp4_dot=mxfp4_dot)
    cfg = mxfp4_moe_config(num_tokens, 2, 4, mxfp4_dot)
    assert cfg.gate_up.block_k == 256
    assert cfg.block_m == (1 if (mxfp4_dot, num_tokens) == ("bits", 1) else 16)
    assert out.dtype == torch.bfloat16
    assert relative_error(out.float().cpu(), ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 6])
def test_gemv_tiles_match_reference(device, dtype, num_tokens):
    """block_m 1: one pair a tile, dequantized weights against x by FMAs (no tl.dot); an
    expert with several pairs reads its weights once per pair."""
    args, (s13, s2), ref = experts_case(num_tokens, dtype, seed=num_tokens)
    args = [t.to(device) for t in args]
    out = swiglu_experts_triton(*args[:7], 1.702, 7.0, w13_scales=s13.to(device),
                                w2_scales=s2.to(device),
                                config=MoeConfig(1, GemmTile(32, 128), GemmTile(16, 256)))
    assert mxfp4_moe_config(1, 4, 32).block_m == 1        # GPT-OSS's batch-1 decode
    assert relative_error(out.float().cpu(), ref) < TOL[dtype]


def test_dot_choice_is_checked(device):
    args, (s13, s2), _ = experts_case(1, torch.float32)
    args = [t.to(device) for t in args]
    scales = dict(w13_scales=s13.to(device), w2_scales=s2.to(device))
    with pytest.raises(ValueError, match="mxfp4_dot"):
        swiglu_experts_triton(*args, 1.702, 7.0, mxfp4_dot="fast", **scales)
    with pytest.raises(ValueError, match="bf16"):
        swiglu_experts_triton(*args, 1.702, 7.0, mxfp4_dot="scaled", **scales)
    with pytest.raises(ValueError, match="block_m 1"):
        swiglu_experts_triton(*[t.to(torch.bfloat16) if t.is_floating_point() else t
                                for t in args[:5]], *args[5:], 1.702, 7.0,
                              mxfp4_dot="scaled", config=MoeConfig(1, GemmTile(32, 128),
                                                                   GemmTile(32, 128)),
                              **scales)
