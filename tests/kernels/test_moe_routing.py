"""The fused MoE router (tllm.kernels.triton.moe_routing) against its torch reference in
every mode the models use: the same expert ids in the same order, weights within 1e-6.
Logits are random and each row is redrawn until its choices (and group scores) are apart by
more than rounding, so ids do not depend on how either side breaks near-ties."""
from __future__ import annotations

import itertools

import pytest
import torch

from tllm.kernels.moe_routing import (MoeRouting, group_scores, route_experts,
                                      route_experts_kernel, route_experts_ref, routing_choice)

MODES = {
    "softmax": dict(),
    "softmax_renorm": dict(renormalize=True),                        # Mixtral, Qwen MoE
    "topk_softmax": dict(topk_first=True),                           # GPT-OSS, Granite
    "topk_sigmoid": dict(topk_first=True, scoring="sigmoid"),        # Llama 4
    "sigmoid_bias": dict(scoring="sigmoid", renormalize=True,        # Nemotron-H, V3 1 group
                         scaling_factor=2.5),
    "sigmoid_bias_grouped": dict(scoring="sigmoid", num_groups=8,    # DeepSeek-V3
                                 topk_group=4, renormalize=True, scaling_factor=2.5),
    "softmax_grouped": dict(num_groups=8, topk_group=3,              # DeepSeek-V2
                            scaling_factor=16.0, scale_after_renormalize=False),
    "softmax_grouped_renorm": dict(num_groups=4, topk_group=2, renormalize=True,
                                   scaling_factor=16.0, scale_after_renormalize=False),
}
WITH_BIAS = {"sigmoid_bias", "sigmoid_bias_grouped"}
NUM_EXPERTS = (8, 128, 512)     # (64 and 256: the grouped modes at 8 and 128 cover their shapes)
TOP_KS = (1, 6, 8, 10)
NUM_TOKENS = (1, 5, 33)


def _too_close(values: torch.Tensor, count: int) -> torch.Tensor:
    """Rows whose `count` largest values (and the next) are not clearly ordered."""
    top = values.sort(dim=-1, descending=True).values[:, :count + 1]
    gaps = (top[:, :-1] - top[:, 1:]).nan_to_num(nan=float("inf"))
    scale = torch.maximum(top[:, :-1].abs(), top[:, 1:].abs()).nan_to_num(posinf=0.0)
    return (gaps <= 1e-5 * scale + 1e-6).any(dim=-1)


def _near_ties(logits, routing: MoeRouting, bias) -> torch.Tensor:
    exact = logits.double()
    bias64 = None if bias is None else bias.double()
    _, choice = routing_choice(exact, routing, bias64)
    close = _too_close(choice, routing.top_k)
    if routing.is_grouped:
        unmasked = routing_choice(exact, MoeRouting(routing.top_k, scoring=routing.scoring),
                                  bias64)[1]
        groups = group_scores(unmasked, routing.num_groups, bias is not None)
        close |= _too_close(groups, routing.topk_group)
    return close


def random_logits(num_tokens, num_experts, dtype, routing, bias, device):
    """Random router logits, rows with near-ties (in float64) redrawn."""
    logits = (torch.randn(num_tokens, num_experts) * 2).to(dtype)
    for _ in range(200):
        redraw = _near_ties(logits, routing, bias)
        if not redraw.any():
            return logits.to(device)
        logits[redraw] = (torch.randn(int(redraw.sum()), num_experts) * 2).to(dtype)
    raise AssertionError("could not draw untied logits")


def cases(mode: str, num_experts: int):
    """(top_k, tokens) pairs for a mode: every k that fits, the token counts in turn."""
    spec = MODES[mode]
    groups = spec.get("num_groups", 1)
    if num_experts % groups:
        return []
    kept = num_experts * spec.get("topk_group", groups) // groups
    top_ks = [k for k in TOP_KS if k <= kept]
    return list(zip(top_ks, itertools.cycle(NUM_TOKENS)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_experts", NUM_EXPERTS)
@pytest.mark.parametrize("mode", list(MODES))
def test_kernel_matches_reference(mode, num_experts, dtype, device):
    torch.manual_seed(num_experts + len(mode))
    for top_k, num_tokens in cases(mode, num_experts):
        routing = MoeRouting(top_k, **MODES[mode])
        bias = (torch.randn(num_experts) * 0.5).to(device) if mode in WITH_BIAS else None
        logits = random_logits(num_tokens, num_experts, dtype, routing,
                               None if bias is None else bias.cpu(), device)
        weights, ids = route_experts_kernel(logits, routing, bias)
        ref_weights, ref_ids = route_experts_ref(logits, routing, bias)
        what = f"{mode} E={num_experts} k={top_k} T={num_tokens}"
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids.long(), ref_ids), what
        assert not weights.isnan().any(), what
        tol = 1e-6 * routing.scaling_factor
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=tol, msg=what)


def test_strided_logits_and_no_tokens(device):
    routing = MoeRouting(4, renormalize=True)
    wide = torch.randn(6, 96, device=device)
    logits = wide[:, 16:80]  # rows of 64 with a stride of 96
    weights, ids = route_experts_kernel(logits, routing, None)
    ref_weights, ref_ids = route_experts_ref(logits, routing)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    empty_weights, empty_ids = route_experts_kernel(logits[:0], routing, None)
    assert empty_weights.shape == empty_ids.shape == (0, 4)


def test_ties_go_to_the_lower_expert(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]], device=device)
    routing = MoeRouting(4)
    _, ids = route_experts_kernel(logits, routing, None)
    assert ids.tolist() == [[1, 2, 4, 5]]
    assert route_experts_ref(logits, routing)[1].tolist() == [[1, 2, 4, 5]]


def test_route_experts_on_cpu_is_the_reference():
    logits = torch.randn(7, 16)
    routing = MoeRouting(3, scoring="sigmoid", num_groups=4, topk_group=2, renormalize=True)
    bias = torch.randn(16)
    weights, ids = route_experts(logits, routing, bias)
    ref_weights, ref_ids = route_experts_ref(logits, routing, bias)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights)


def test_bad_arguments_are_refused():
    logits = torch.randn(3, 16)
    with pytest.raises(ValueError, match="router_logits"):
        route_experts(logits[0], MoeRouting(2))
    with pytest.raises(ValueError, match="correction_bias"):
        route_experts(logits, MoeRouting(2), torch.randn(8))
    with pytest.raises(ValueError, match="correction_bias"):
        route_experts(logits, MoeRouting(2, topk_first=True), torch.randn(16))
    with pytest.raises(ValueError, match="n_group"):
        route_experts(logits, MoeRouting(2, topk_first=True, num_groups=4, topk_group=2))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        route_experts(logits, MoeRouting(17))
    with pytest.raises(ValueError, match="scoring_func"):
        route_experts(logits, MoeRouting(2, scoring="relu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_routing_in_a_cuda_graph():
    routing = MoeRouting(8, scoring="sigmoid", num_groups=8, topk_group=4,
                         renormalize=True, scaling_factor=2.5)
    bias = torch.randn(256, device="cuda") * 0.5
    logits = torch.randn(16, 256, device="cuda")
    route_experts(logits, routing, bias)  # warm up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_experts(logits, routing, bias)
    fresh = random_logits(16, 256, torch.float32, routing, bias.cpu(), "cuda")
    logits.copy_(fresh)
    graph.replay()
    ref_weights, ref_ids = route_experts_ref(fresh, routing, bias)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=2.5e-6)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # 40 x 8 pairs: more than one sort chunk
def test_routed_ids_sort_like_the_reference(num_tokens, device):
    """Routing then align_pairs: two launches at decode sizes (one chunk of pairs)."""
    from tllm.kernels.moe import align_pairs_ref
    from tllm.kernels.triton.fused_moe import align_pairs
    routing = MoeRouting(8, renormalize=True)
    logits = random_logits(num_tokens, 128, torch.bfloat16, routing, None, device)
    _, ids = route_experts_kernel(logits, routing, None)
    blocks = align_pairs(ids, 128, 16)
    want_pairs, want_experts = align_pairs_ref(route_experts_ref(logits, routing)[1].cpu(),
                                               128, 16)
    used = int(blocks.num_padded.item())
    assert used == want_pairs.numel()
    assert torch.equal(blocks.sorted_pairs[:used].cpu(), want_pairs)
    assert torch.equal(blocks.block_expert[:used // 16].cpu(), want_experts)
