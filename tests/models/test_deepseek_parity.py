"""DeepSeek-V2 and V3 (MLA over the latent KV cache, grouped top-k routing, shared experts,
dense first layers) against HF transformers (fp32, CPU): greedy tokens equal and top-5
logprobs within 1e-3 over one continuous batch with chunked prefill, queued requests, prefix
reuse and small KV blocks (the rules of test_hf_parity.py). V3 runs with q_lora_rank, YaRN
rope with mscale, sigmoid scores, a random correction bias and renormalised, scaled weights;
V2 as V2-Lite (no q_lora_rank), default rope, softmax and group_limited_greedy."""
from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import (assert_greedy_matches_hf, generate_batch, hf_greedy,
                                       make_prompts)

NUM_NEW = 12
COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
              initializer_range=0.1, eos_token_id=2, bos_token_id=1, pad_token_id=0,
              kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2)
CONFIGS = {
    "DeepseekV3": dict(q_lora_rank=48, routed_scaling_factor=2.5, norm_topk_prob=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                        "factor": 4.0, "original_max_position_embeddings": 64,
                                        "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0}),
    "DeepseekV2": dict(q_lora_rank=None, routed_scaling_factor=1.5, norm_topk_prob=False,
                       topk_method="group_limited_greedy"),
}


def tiny_deepseek_config(arch: str):
    import transformers
    return getattr(transformers, f"{arch}Config")(**COMMON, **CONFIGS[arch],
                                                  architectures=[f"{arch}ForCausalLM"])


def make_tiny_deepseek(arch: str, path, seed: int = 0):
    """Save a random HF DeepSeek model; its norms and V3's correction bias random too (HF
    initialises them to 1 and 0)."""
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(tiny_deepseek_config(arch)).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                tensor.normal_(1.0, 0.3)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_deepseek(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny_{request.param.lower()}")
    return path, make_tiny_deepseek(request.param, path)


def test_greedy_matches_hf_in_continuous_batch(tiny_deepseek):
    path, hf_model = tiny_deepseek
    prompts = make_prompts(hf_model.config.vocab_size)
    assert_greedy_matches_hf(hf_model, prompts, generate_batch(path, prompts, NUM_NEW), NUM_NEW)


def test_cached_latents_are_reused(tiny_deepseek):
    """One tensor per layer, one head of kv_lora_rank + rope dims per token; a prompt sent
    again reads its prefix's latents from the cache and still gives HF's tokens."""
    from tllm import LLM, KvCacheConfig, SamplingParams
    path, hf_model = tiny_deepseek
    config = hf_model.config
    prompt = make_prompts(config.vocab_size)[7]
    ref_tokens, _ = hf_greedy(hf_model, prompt, 4)
    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM(str(path), kv_cache_config=KvCacheConfig(tokens_per_block=4,
                                                      max_tokens=256)) as llm:
        kv = llm._engine.kv_cache
        assert len(kv.kv_caches) == config.num_hidden_layers
        for k, v in kv.kv_caches:
            assert v is k
            assert k.shape[2:] == (1, config.kv_lora_rank + config.qk_rope_head_dim)
        for _ in range(2):
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            assert out.outputs[0].token_ids == ref_tokens
        # every full block but the one holding the last prompt token (recomputed)
        assert llm.get_kv_cache_stats()["blocks_reused"] == (len(prompt) - 1) // 4


# the published totals: 15.7B (DeepSeek-V2-Lite), "16B" (Moonlight-16B-A3B: 15.96B here)
@pytest.mark.parametrize("preset,billions", [("deepseek-v2-lite", 15.7),
                                             ("moonlight-16b-a3b", 16.0)])
def test_dummy_presets_have_the_real_shapes(preset, billions):
    """Built on the meta device: the published sizes, a 576-value latent cache."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.loader.dummy import dummy_config
    model = loader.build_model(dummy_config(preset), get_attention_backend("torch"),
                               torch.bfloat16, torch.device("meta"), 4096)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)
    spec = model.kv_cache_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.keys_only) == (
        27, 1, 576, True)
    assert tuple(model.layers[1].mlp.experts.w13_weight.shape) == (64, 2 * 1408, 2048)
