"""DeepSeek's grouped top-k routing against transformers' routers (same logits): the same
experts and weights per token, for V3 (sigmoid, correction bias, top-2-sum groups, one group
or several) and V2 (softmax, greedy or group_limited_greedy, scaled)."""
from __future__ import annotations

import pytest
import torch

from tllm.layers.grouped_topk import GroupedRouting, grouped_topk
from tllm.models.deepseek.moe import v2_routing, v3_routing

COMMON = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
              num_attention_heads=4)


def by_expert(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


def check(hf_router, routing: GroupedRouting, bias):
    hidden = torch.randn(64, COMMON["hidden_size"])
    logits, hf_weights, hf_ids = hf_router(hidden)
    weights, ids = grouped_topk(logits, routing, bias)
    hf_ids, hf_weights = by_expert(hf_weights, hf_ids)
    ids, weights = by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
def test_v3_routing_matches_hf(n_group, topk_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    torch.manual_seed(n_group)
    config = DeepseekV3Config(**COMMON, n_group=n_group, topk_group=topk_group,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0.0, 0.5)
    check(router, v3_routing(config), router.e_score_correction_bias)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_hf(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    torch.manual_seed(1)
    config = DeepseekV2Config(**COMMON, n_group=4, topk_group=2, topk_method=method,
                              routed_scaling_factor=16.0, norm_topk_prob=False)
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
    check(router, v2_routing(config), None)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="n_group"):
        GroupedRouting(top_k=2, num_groups=3, topk_group=1).check(16)
    with pytest.raises(ValueError, match="topk_group"):
        GroupedRouting(top_k=2, num_groups=4, topk_group=5).check(16)
    with pytest.raises(ValueError, match="topk_method"):
        v2_routing(type("C", (), {"topk_method": "noaux_tc", "num_experts_per_tok": 2})())


def test_which_layers_have_experts():
    from types import SimpleNamespace
    from tllm.models.deepseek.moe import is_moe_layer
    config = SimpleNamespace(n_routed_experts=8, first_k_dense_replace=1, moe_layer_freq=2)
    assert [is_moe_layer(config, i) for i in range(6)] == [False, False, True, False, True,
                                                           False]
    assert not is_moe_layer(SimpleNamespace(n_routed_experts=None), 3)
