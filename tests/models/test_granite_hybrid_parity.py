"""Granite 4.0-H (GraniteMoeHybridForCausalLM: Mamba-2 and attention layers, each followed by
a shared SwiGLU MLP and a top-k MoE, Granite's multipliers) against HF transformers (fp32):
greedy tokens equal and top-5 logprobs within 1e-3 over a continuous batch with chunked
prefill and reused state slots; with and without RoPE, with and without experts."""
from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import TOP, assert_greedy_matches_hf, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams

transformers = pytest.importorskip("transformers")

NUM_NEW = 8
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
            mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=8,
            num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba", "mamba"],
            num_hidden_layers=4, embedding_multiplier=3.0, attention_multiplier=0.2,
            residual_multiplier=0.5, logits_scaling=2.0, max_position_embeddings=256,
            eos_token_id=2, bos_token_id=1, pad_token_id=0)


def _hf_norm_is_grouped() -> bool:
    """transformers before 5.2x normalised the gated norm over all Mamba groups at once (a bug
    since fixed); with one group, as the real checkpoints have, the two agree."""
    import inspect
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf
    return "group_size" in inspect.signature(hf.GraniteMoeHybridRMSNormGated).parameters


def save_tiny(path, **extra):
    if not _hf_norm_is_grouped():
        extra.setdefault("mamba_n_groups", 1)
    config = transformers.GraniteMoeHybridConfig(**{**TINY, **extra})
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".D", ".dt_bias")):
                param.copy_(param.mean() + 0.2 * torch.randn_like(param))
            if name.endswith(".A_log"):   # slow decay: a stale state would show
                param.copy_((0.01 + 0.05 * torch.rand_like(param)).log())
            if "block_sparse_moe" in name or "shared_mlp" in name:
                param.mul_(5)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("rope,experts", [("rope", 4), (None, 0)], ids=["rope-moe", "nope-dense"])
def test_greedy_matches_hf_in_continuous_batch(tmp_path, rope, experts):
    hf_model = save_tiny(tmp_path, position_embedding_type=rope, num_local_experts=experts)
    prompts = make_prompts(TINY["vocab_size"])[:6]
    with LLM(str(tmp_path), max_num_tokens=24, max_batch_size=3,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=NUM_NEW, temperature=0,
                                              ignore_eos=True, logprobs=TOP), use_tqdm=False)
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW)
