"""The MXFP4 dequant-in-GEMM MoE kernels against the torch reference (the reference decoder,
then the biased clamped-SwiGLU experts in float32), on fresh random routings, with and
without expert parallelism."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402
from tllm.kernels.swiglu_moe import swiglu_experts_ref  # noqa: E402
from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig  # noqa: E402
from tllm.kernels.triton.mxfp4_moe import mxfp4_experts_triton  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HIDDEN, INTER = 96, 64  # K of 3 and 2 scale groups: a partial 64-column K tile
ALPHA, LIMIT = 1.702, 1.0
SMALL = MoeConfig(16, GemmTile(32, 64, 4, 1), GemmTile(32, 64, 4, 1))


def packed_experts(num_experts, dtype, device, g):
    def packed(rows, k):
        blocks = torch.randint(0, 256, (num_experts, rows, k // 32, 16), dtype=torch.uint8,
                               generator=g)
        # scales near 2^-5: outputs of order one, so the clamp is reached now and then
        scales = torch.randint(120, 124, (num_experts, rows, k // 32), dtype=torch.uint8,
                               generator=g)
        return blocks.to(device), scales.to(device)
    w13 = packed(2 * INTER, HIDDEN)
    w2 = packed(HIDDEN, INTER)
    b13 = (torch.randn(num_experts, 2 * INTER, generator=g) * 0.5).to(dtype).to(device)
    b2 = (torch.randn(num_experts, HIDDEN, generator=g) * 0.5).to(dtype).to(device)
    return w13, b13, w2, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k,expert_start", [(1, 2, 0), (11, 2, 0), (9, 3, 2)])
def test_mxfp4_experts_match_reference(device, dtype, num_tokens, top_k, expert_start):
    g = torch.Generator().manual_seed(num_tokens)
    num_experts = 4
    (w13, s13), b13, (w2, s2), b2 = packed_experts(num_experts, dtype, device, g)
    hidden = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype).to(device)
    logits = torch.randn(num_tokens, num_experts + expert_start, generator=g)
    values, ids = logits.topk(top_k, -1)
    weights = values.softmax(-1)
    out = mxfp4_experts_triton(hidden, w13, s13, b13, w2, s2, b2, weights.to(device),
                               ids.to(device), ALPHA, LIMIT, expert_start, config=SMALL)

    def expert(e):
        return (dequantize_mxfp4(w13[e].cpu(), s13[e].cpu()), b13[e].float().cpu(),
                dequantize_mxfp4(w2[e].cpu(), s2[e].cpu()), b2[e].float().cpu())
    ref = swiglu_experts_ref(hidden.float().cpu(), expert, num_experts, weights, ids, ALPHA,
                             LIMIT, expert_start)
    assert out.dtype == dtype
    assert relative_error(out.cpu(), ref) < TOL[dtype]
