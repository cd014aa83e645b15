"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens and top-5 logprobs
equal HF transformers' (fp32, CPU) over one continuous batch with chunked prefill, queued
requests, prefix reuse and small KV blocks (the rules of test_hf_parity.py)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from tests.models.hf_reference import assert_greedy_matches_hf, generate_batch, make_prompts

NUM_NEW = 16
# a few experts, top-2; Qwen2-MoE with a shared expert and layer 1 dense (mlp_only_layers)
MOE_CONFIGS = {
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "Qwen2Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, mlp_only_layers=[1],
                     norm_topk_prob=False),
    "Qwen3Moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     head_dim=16, norm_topk_prob=True),
}


def make_tiny_moe(arch: str, path, seed: int = 0, **overrides):
    """Save a random HF MoE model of the given family; returns the HF model."""
    import transformers
    torch.manual_seed(seed)
    config = getattr(transformers, f"{arch}Config")(
        **{**TINY, **MOE_CONFIGS[arch], **overrides}, architectures=[f"{arch}ForCausalLM"])
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_greedy_matches_hf_in_continuous_batch(arch, tmp_path):
    hf_model = make_tiny_moe(arch, tmp_path)
    prompts = make_prompts(hf_model.config.vocab_size)
    outputs = generate_batch(tmp_path, prompts, NUM_NEW)
    assert all(len(output.outputs[0].token_ids) == NUM_NEW for output in outputs)
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW)
