"""GPT-OSS's experts on the sort-free decode path (tllm.kernels.triton.swiglu_moe_decode)
against swiglu_experts_ref: MXFP4 and plain weights, biases on and off, expert parallelism,
and the dispatcher taking it for a decode step's few pairs."""
import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_swiglu_moe_kernels import (ALPHA, HIDDEN, INTER, LIMIT, TOL,  # noqa: E402
                                                   packed, routing)
from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402
from tllm.kernels.swiglu_moe import swiglu_experts_ref  # noqa: E402
from tllm.kernels.triton import swiglu_moe, swiglu_moe_decode  # noqa: E402
from tllm.kernels.triton.swiglu_moe import swiglu_experts_triton  # noqa: E402


def experts(num_experts, dtype, mxfp4, g):
    (w13, s13), (w2, s2) = packed(num_experts, 2 * INTER, HIDDEN, g), packed(num_experts,
                                                                              HIDDEN, INTER, g)
    b13 = (torch.randn(num_experts, 2 * INTER, generator=g) * 0.5).to(dtype)
    b2 = (torch.randn(num_experts, HIDDEN, generator=g) * 0.5).to(dtype)
    dense13, dense2 = dequantize_mxfp4(w13, s13), dequantize_mxfp4(w2, s2)
    if not mxfp4:  # the same values as plain weights
        w13, w2, s13, s2 = dense13.to(dtype), dense2.to(dtype), None, None
    return (w13, b13, w2, b2, s13, s2), (dense13, dense2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "plain"])
@pytest.mark.parametrize("num_tokens,top_k,expert_start,down_bias",
                         [(1, 2, 0, True), (3, 2, 2, True), (2, 3, 0, False)])
def test_decode_path_matches_reference(device, dtype, mxfp4, num_tokens, top_k, expert_start,
                                       down_bias):
    g = torch.Generator().manual_seed(num_tokens + 10 * top_k)
    num_experts = 4
    (w13, b13, w2, b2, s13, s2), (dense13, dense2) = experts(num_experts, dtype, mxfp4, g)
    b2 = b2 if down_bias else None
    hidden = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    weights, ids = routing(num_tokens, top_k, num_experts + expert_start, g)
    on = [t.to(device) if t is not None else None for t in (hidden, w13, b13, w2, b2, s13, s2)]
    out = swiglu_experts_triton(on[0], on[1], on[2], on[3], on[4], weights.to(device),
                                ids.to(device), ALPHA, LIMIT, expert_start, w13_scales=on[5],
                                w2_scales=on[6], decode=True)

    def expert(e):
        return dense13[e], b13[e].float(), dense2[e], None if b2 is None else b2[e].float()
    ref = swiglu_experts_ref(hidden.float(), expert, num_experts, weights, ids, ALPHA, LIMIT,
                             expert_start)
    assert out.dtype == dtype
    assert relative_error(out.cpu(), ref) < TOL[dtype]
    if expert_start:  # tokens with no pair on this rank get zeros
        nothing_here = ((ids < expert_start) | (ids >= expert_start + num_experts)).all(-1)
        assert (out.cpu()[nothing_here] == 0).all()


def test_the_dispatcher_takes_it_for_few_pairs(device, monkeypatch):
    taken = []
    real = swiglu_moe_decode.swiglu_decode_experts
    monkeypatch.setattr(swiglu_moe, "swiglu_decode_experts",
                        lambda *a, **kw: taken.append(a[0].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    (w13, b13, w2, b2, s13, s2), _ = experts(8, torch.float32, True, g)
    args = [t.to(device) for t in (w13, b13, w2, b2)]
    for num_tokens in (1, 2, 3):            # 2 pairs a token: 6 > 8 / 4
        hidden = torch.randn(num_tokens, HIDDEN, generator=g).to(device)
        weights, ids = routing(num_tokens, 2, 8, g)
        swiglu_experts_triton(hidden, *args, weights.to(device), ids.to(device), ALPHA, LIMIT,
                              w13_scales=s13.to(device), w2_scales=s2.to(device))
    assert taken == [1]
