"""GPT-OSS's expert kernels (biases, clamped SwiGLU; weights in the model's dtype or MXFP4
blocks dequantized in the GEMM) against the torch reference (the reference decoder, then the
experts in float32), on fresh random routings, with and without expert parallelism."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402
from tllm.kernels.swiglu_moe import swiglu_experts_ref  # noqa: E402
from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig  # noqa: E402
from tllm.kernels.triton.swiglu_moe import swiglu_experts_triton  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HIDDEN, INTER = 96, 64  # K of 3 and 2 scale groups: a partial 64-column K tile
ALPHA, LIMIT = 1.702, 1.0
SMALL = MoeConfig(16, GemmTile(32, 64, 4, 1), GemmTile(32, 64, 4, 1))


def packed(num_experts, rows, k, g):
    blocks = torch.randint(0, 256, (num_experts, rows, k // 32, 16), dtype=torch.uint8,
                           generator=g)
    # scales near 2^-5: outputs of order one, so the clamp is reached now and then
    scales = torch.randint(120, 124, (num_experts, rows, k // 32), dtype=torch.uint8,
                           generator=g)
    return blocks, scales


def routing(num_tokens, top_k, num_global, g):
    values, ids = torch.randn(num_tokens, num_global, generator=g).topk(top_k, -1)
    return values.softmax(-1), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "plain"])
@pytest.mark.parametrize("num_tokens,top_k,expert_start", [(1, 2, 0), (11, 2, 0), (9, 3, 2)])
def test_experts_match_reference(device, dtype, mxfp4, num_tokens, top_k, expert_start):
    g = torch.Generator().manual_seed(num_tokens)
    num_experts = 4
    (w13, s13), (w2, s2) = packed(num_experts, 2 * INTER, HIDDEN, g), packed(num_experts,
                                                                              HIDDEN, INTER, g)
    b13 = (torch.randn(num_experts, 2 * INTER, generator=g) * 0.5).to(dtype)
    b2 = (torch.randn(num_experts, HIDDEN, generator=g) * 0.5).to(dtype)
    dense13, dense2 = dequantize_mxfp4(w13, s13), dequantize_mxfp4(w2, s2)
    if not mxfp4:  # the same values as plain weights
        w13, w2, s13, s2 = dense13.to(dtype), dense2.to(dtype), None, None
    hidden = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    weights, ids = routing(num_tokens, top_k, num_experts + expert_start, g)
    on = [t.to(device) if t is not None else None for t in (hidden, w13, b13, w2, b2, s13, s2)]
    out = swiglu_experts_triton(on[0], on[1], on[2], on[3], on[4], weights.to(device),
                                ids.to(device), ALPHA, LIMIT, expert_start, w13_scales=on[5],
                                w2_scales=on[6], config=SMALL)

    def expert(e):
        return dense13[e], b13[e].float(), dense2[e], b2[e].float()
    ref = swiglu_experts_ref(hidden.float(), expert, num_experts, weights, ids, ALPHA, LIMIT,
                             expert_start)
    assert out.dtype == dtype
    assert relative_error(out.cpu(), ref) < TOL[dtype]


def test_without_down_bias(device):
    """A tensor-parallel rank other than the first adds no down bias."""
    g = torch.Generator().manual_seed(5)
    (w13, s13), (w2, s2) = packed(2, 2 * INTER, HIDDEN, g), packed(2, HIDDEN, INTER, g)
    b13 = torch.randn(2, 2 * INTER, generator=g)
    hidden = torch.randn(6, HIDDEN, generator=g)
    weights, ids = routing(6, 1, 2, g)
    out = swiglu_experts_triton(*(t.to(device) for t in (hidden, w13, b13, w2)), None,
                                weights.to(device), ids.to(device), ALPHA, LIMIT,
                                w13_scales=s13.to(device), w2_scales=s2.to(device),
                                config=SMALL)
    ref = swiglu_experts_ref(
        hidden, lambda e: (dequantize_mxfp4(w13[e], s13[e]), b13[e],
                           dequantize_mxfp4(w2[e], s2[e]), None), 2, weights, ids, ALPHA, LIMIT)
    assert relative_error(out.cpu(), ref) < 1e-5
