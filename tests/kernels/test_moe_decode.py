"""The sort-free decode path of the fused MoE (tllm.kernels.triton.moe_decode) against the
torch references on fresh random routings: gated SiLU and relu2 experts, several tokens,
expert parallelism (pairs of other ranks' experts add nothing), launch tiles that loop over
K with a ragged last step; and when the dispatcher takes it."""
import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_fused_moe import HIDDEN, INTER, TOL, experts, reference, routing  # noqa: E402
from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import moe  # noqa: E402
from tllm.kernels.triton import fused_moe, moe_decode  # noqa: E402
from tllm.kernels.triton.fused_moe import GemmTile  # noqa: E402
from tllm.kernels.triton.moe_decode import MoeDecodeConfig  # noqa: E402

# 16 columns a step over K = 40 (hidden) and 24 (intermediate): three and two steps, the
# last ragged; 2-4 output columns a program: several n tiles, the last partial
LOOPING = MoeDecodeConfig(GemmTile(2, 16, 2, 2), GemmTile(4, 16, 2, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 1), (1, 8, 2), (3, 32, 4)])
@pytest.mark.parametrize("config", [None, LOOPING], ids=["default", "looping"])
def test_decode_experts_match_reference(device, dtype, num_tokens, num_experts, top_k,
                                        config):
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype).to(device)
    w13, w2 = experts(num_experts, dtype, device)
    weights, ids = routing(num_tokens, top_k, num_experts, device)
    out = moe_decode.decode_experts(hidden, w13, w2, weights, ids, config=config)
    assert out.shape == hidden.shape and out.dtype == dtype
    err = relative_error(out.cpu(), reference(hidden, w13, w2, weights, ids))
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_experts_on_the_decode_path(device, dtype):
    num_tokens, num_experts, top_k = 2, 16, 3
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype).to(device)
    w1 = (torch.randn(num_experts, INTER, HIDDEN) / HIDDEN ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(num_experts, HIDDEN, INTER) / INTER ** 0.5).to(dtype).to(device)
    weights, ids = routing(num_tokens, top_k, num_experts, device)
    out = moe_decode.decode_experts(hidden, w1, w2, weights, ids, activation="relu2",
                                    config=LOOPING)
    want = moe.relu2_experts_ref(hidden.float().cpu(), w1.float().cpu(), w2.float().cpu(),
                                 weights.cpu(), ids.cpu())
    assert relative_error(out.cpu(), want) < TOL[dtype]


@pytest.mark.parametrize("expert_start", [0, 3])
def test_pairs_of_other_ranks_add_nothing(device, expert_start):
    num_tokens, top_k, local = 3, 2, 4       # this rank holds 4 of 10 experts
    hidden = torch.randn(num_tokens, HIDDEN, device=device)
    w13, w2 = experts(local, torch.float32, device)
    weights, ids = routing(num_tokens, top_k, 10, device)
    ids = ids.int()
    ids[0] = torch.tensor([8, 9])             # outside both ranks' ranges
    out = moe_decode.decode_experts(hidden, w13, w2, weights, ids, expert_start)
    want = reference(hidden, w13, w2, weights, ids, expert_start)
    assert relative_error(out.cpu(), want) < TOL[torch.float32]
    nothing_here = ((ids < expert_start) | (ids >= expert_start + local)).all(-1).cpu()
    assert nothing_here[0] and (out.cpu()[nothing_here] == 0).all()


def test_the_dispatcher_takes_it_for_few_pairs(device, monkeypatch):
    taken = []
    real = moe_decode.decode_experts
    monkeypatch.setattr(fused_moe, "decode_experts",
                        lambda *a, **kw: taken.append(a[4].shape[0]) or real(*a, **kw))
    w13, w2 = experts(32, torch.float32, device)
    for num_tokens in (1, 2, 5):              # 5 tokens x 2 = 10 pairs > 32 / 4
        hidden = torch.randn(num_tokens, HIDDEN, device=device)
        weights, ids = routing(num_tokens, 2, 32, device)
        out = fused_moe.fused_experts_triton(hidden, w13, w2, weights, ids)
        assert relative_error(out.cpu(), reference(hidden, w13, w2, weights, ids)) < 1e-5
    assert taken == [1, 2]


def test_use_decode_path():
    assert moe_decode.use_decode_path(1, 2, 8)           # Mixtral, batch 1
    assert not moe_decode.use_decode_path(2, 2, 8)
    assert moe_decode.use_decode_path(4, 8, 128)         # Qwen3-30B-A3B, up to 4 tokens
    assert not moe_decode.use_decode_path(5, 8, 128)
    assert not moe_decode.use_decode_path(0, 8, 128)


def test_the_switch_sends_every_step_to_the_tile_path(monkeypatch):
    # TLLM_MOE_DECODE_PATH=0, read at import
    monkeypatch.setattr(moe_decode, "_DECODE_PATH_ON", False)
    assert not moe_decode.use_decode_path(1, 2, 8)
    assert not moe_decode.use_decode_path(4, 8, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,expert_start", [("channel", 0), ("tensor", 2), ("block", 0),
                                                 ("block", 2)])
def test_fp8_experts_on_the_decode_path(device, scheme, dtype, expert_start):
    """W8A16 against fused_experts_ref on the dequantized weights; 32 x 32 scale blocks over
    K = 48 (a ragged second block) and 16-column K tiles: two tiles a scale block."""
    from tests.kernels.test_fp8_moe_kernel import (HIDDEN as H8, TOL as TOL8, dequantized_ref,
                                                   fp8_experts, run_triton)
    num_tokens, top_k = 2, 3
    experts8 = fp8_experts(4, scheme, device)
    hidden = torch.randn(num_tokens, H8, device=device).to(dtype)
    weights, ids = routing(num_tokens, top_k, 4 + expert_start, device)
    want = dequantized_ref(hidden, experts8, weights, ids, expert_start)
    out = run_triton(hidden, experts8, weights, ids, expert_start=expert_start, decode=True)
    assert relative_error(out.cpu(), want) < TOL8[dtype, False]
    looping = moe_decode.decode_experts(
        hidden, experts8.w13, experts8.w2, weights, ids, expert_start, config=LOOPING,
        w13_scale=experts8.w13_scale, w2_scale=experts8.w2_scale, block=experts8.block)
    assert relative_error(looping.cpu(), want) < TOL8[dtype, False]
