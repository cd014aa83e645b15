"""The fused MoE Triton kernels against their torch references: the sort of (token, expert)
pairs by expert (against align_pairs_ref, exactly), and the whole gate_up -> SiLU-and-mul ->
down -> weighted top-k sum against fused_experts_ref on float32 copies of the inputs, on
fresh random routings, with and without expert parallelism."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import moe  # noqa: E402
from tllm.kernels.triton import fused_moe  # noqa: E402
from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig  # noqa: E402

# bf16: the output and the intermediate rounded to 8 bits each; one draw in a few hundred
# reached 1.01e-2 (seen once the test order, and so the random inputs, varied under xdist)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
HIDDEN, INTER = 40, 24  # not multiples of any tile


def routing(num_tokens, top_k, num_global, device, generator=None):
    """Distinct experts per token from random logits, softmax weights renormalised."""
    logits = torch.randn(num_tokens, num_global, generator=generator)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(device), ids.to(device)


def experts(num_experts, dtype, device, hidden=HIDDEN, inter=INTER):
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(num_experts, hidden, inter) / inter ** 0.5).to(dtype).to(device)
    return w13, w2


def reference(hidden, w13, w2, weights, ids, expert_start=0):
    """fused_experts_ref in float32 on the same (rounded) inputs."""
    return moe.fused_experts_ref(hidden.float().cpu(), w13.float().cpu(), w2.float().cpu(),
                                 weights.cpu(), ids.cpu(), expert_start)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [
    (1, 1, 4), (1, 2, 8), (13, 2, 5), (37, 2, 4), (29, 8, 128)])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("expert_start", [0, 2])
def test_align_pairs_matches_reference(device, num_tokens, top_k, num_experts, block_m,
                                       expert_start):
    _, ids = routing(num_tokens, top_k, num_experts + 3, device)
    # chunk 16: several programs, so the counts of earlier chunks are exercised
    blocks = fused_moe.align_pairs(ids, num_experts, block_m, expert_start, chunk=16)
    want_pairs, want_experts = moe.align_pairs_ref(ids, num_experts, block_m, expert_start)
    used = int(blocks.num_padded.item())
    assert used == want_pairs.numel()
    assert torch.equal(blocks.sorted_pairs[:used].cpu(), want_pairs)
    tiles = used // block_m
    assert torch.equal(blocks.block_expert[:tiles].cpu(), want_experts)
    assert (blocks.block_expert[tiles:] == -1).all()
    assert blocks.max_blocks >= tiles


def test_align_pairs_default_chunk_many_experts(device):
    _, ids = routing(300, 8, 128, device)  # 2400 pairs: several default-size chunks
    blocks = fused_moe.align_pairs(ids, 128, 16)
    want_pairs, want_experts = moe.align_pairs_ref(ids, 128, 16)
    used = int(blocks.num_padded.item())
    assert torch.equal(blocks.sorted_pairs[:used].cpu(), want_pairs)
    assert torch.equal(blocks.block_expert[:used // 16].cpu(), want_experts)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 8, 128, 16), (3, 8, 128, 16), (1, 2, 8, 128), (5, 4, 32, 16)])
def test_align_pairs_default_chunk_decode_sizes(device, num_tokens, top_k, num_experts,
                                                block_m):
    """A decode step's few pairs: one chunk and a tile loop sized to them."""
    _, ids = routing(num_tokens, top_k, num_experts, device)
    blocks = fused_moe.align_pairs(ids, num_experts, block_m)
    want_pairs, want_experts = moe.align_pairs_ref(ids, num_experts, block_m)
    used = int(blocks.num_padded.item())
    assert torch.equal(blocks.sorted_pairs[:used].cpu(), want_pairs)
    assert torch.equal(blocks.block_expert[:used // block_m].cpu(), want_experts)
    assert (blocks.block_expert[used // block_m:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2)])
def test_fused_experts_matches_reference(device, dtype, num_tokens, num_experts, top_k):
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype).to(device)
    w13, w2 = experts(num_experts, dtype, device)
    weights, ids = routing(num_tokens, top_k, num_experts, device)
    # the tile path at one token too (it would take moe_decode's path by default)
    out = fused_moe.fused_experts_triton(hidden, w13, w2, weights, ids, decode=False)
    assert out.shape == hidden.shape and out.dtype == dtype
    err = relative_error(out.cpu(), reference(hidden, w13, w2, weights, ids))
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 1), (13, 8, 2), (29, 16, 6)])
def test_relu2_experts_match_reference(device, dtype, num_tokens, num_experts, top_k):
    """Nemotron-H's non-gated squared-ReLU experts on the same kernels (w1 [E, I, H])."""
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype).to(device)
    w1 = (torch.randn(num_experts, INTER, HIDDEN) / HIDDEN ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(num_experts, HIDDEN, INTER) / INTER ** 0.5).to(dtype).to(device)
    weights, ids = routing(num_tokens, top_k, num_experts, device)
    out = fused_moe.fused_experts_triton(hidden, w1, w2, weights, ids, activation="relu2")
    assert out.shape == hidden.shape and out.dtype == dtype
    want = moe.relu2_experts_ref(hidden.float().cpu(), w1.float().cpu(), w2.float().cpu(),
                                 weights.cpu(), ids.cpu())
    err = relative_error(out.cpu(), want)
    assert err < TOL[dtype], err


def test_relu2_experts_refuse_mismatched_weights():
    with pytest.raises(ValueError, match="w1"):
        moe.relu2_experts(torch.randn(2, HIDDEN), torch.randn(4, INTER, HIDDEN),
                          torch.randn(4, INTER, HIDDEN), torch.ones(2, 1),
                          torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expert_start", [0, 3])
def test_expert_parallel_pairs_elsewhere_add_nothing(device, dtype, expert_start):
    # this rank holds 4 of 10 experts; int32 ids, as a router may hand them over
    num_tokens, top_k, local = 11, 2, 4
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype).to(device)
    w13, w2 = experts(local, dtype, device)
    weights, ids = routing(num_tokens, top_k, 10, device)
    ids = ids.int()
    ids[0] = torch.tensor([8, 9])  # outside both ranks' ranges
    out = fused_moe.fused_experts_triton(hidden, w13, w2, weights, ids, expert_start)
    want = reference(hidden, w13, w2, weights, ids, expert_start)
    assert relative_error(out.cpu(), want) < TOL[dtype]
    nothing_here = ((ids < expert_start) | (ids >= expert_start + local)).all(-1).cpu()
    assert (out.cpu()[nothing_here] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_tiles_many_programs(device, dtype):
    # several m tiles per expert, n tiles and uneven k steps, grouped program order
    num_tokens, top_k, num_experts = 37, 2, 4
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype).to(device)
    w13, w2 = experts(num_experts, dtype, device)
    weights, ids = routing(num_tokens, top_k, num_experts, device)
    cfg = MoeConfig(16, GemmTile(16, 16, 2, 2), GemmTile(16, 32, 2, 2), group_m=2)
    out = fused_moe.fused_experts_triton(hidden, w13, w2, weights, ids, config=cfg)
    assert relative_error(out.cpu(), reference(hidden, w13, w2, weights, ids)) < TOL[dtype]


def test_no_tokens(device):
    w13, w2 = experts(4, torch.float32, device)
    hidden = torch.empty(0, HIDDEN, device=device)
    weights, ids = routing(0, 2, 4, device)
    assert fused_moe.fused_experts_triton(hidden, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_config_by_tokens_per_expert():
    decode = fused_moe.moe_config(1, 8, 128)
    assert decode.block_m == 16
    assert fused_moe.moe_config(4096, 2, 8).block_m >= 64


def test_dispatch_on_cpu_is_the_reference():
    hidden = torch.randn(5, HIDDEN)
    w13, w2 = experts(4, torch.float32, "cpu")
    weights, ids = routing(5, 2, 4, "cpu")
    assert torch.equal(moe.fused_experts(hidden, w13, w2, weights, ids),
                       moe.fused_experts_ref(hidden, w13, w2, weights, ids))


@pytest.mark.parametrize("bad,name", [("w2", "w2"), ("ids", "topk_ids"),
                                      ("weights", "topk_weights"), ("dtype", "w13"),
                                      ("start", "expert_start")])
def test_bad_arguments_name_themselves(bad, name):
    hidden = torch.randn(5, HIDDEN)
    w13, w2 = experts(4, torch.float32, "cpu")
    weights, ids = routing(5, 2, 4, "cpu")
    args = {"hidden": hidden, "w13": w13, "w2": w2, "topk_weights": weights,
            "topk_ids": ids, "expert_start": 0}
    if bad == "w2":
        args["w2"] = w2[:, :, :-1]
    elif bad == "ids":
        args["topk_ids"] = ids[:-1]
    elif bad == "weights":
        args["topk_weights"] = weights[:, :1]
    elif bad == "dtype":
        args["w13"] = w13.double()
    else:
        args["expert_start"] = -1
    with pytest.raises(ValueError, match=name):
        moe.fused_experts(**args)
