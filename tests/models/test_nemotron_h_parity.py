"""NemotronH (Mamba-2 + attention + squared-ReLU MLP blocks) against HF transformers (fp32):
greedy tokens equal and top-5 logprobs within 1e-3 over a continuous batch with chunked
prefill (24-token steps, prompts up to 60 tokens); 3 requests at a time so state slots are
reused (the Mamba decay is slowed so that a state left in a slot would change the tokens);
requests finishing at different steps; prompts sharing prefixes (block reuse is on by default
and must not hand a hybrid a prefix without its state); preemption with recompute under a
small KV cache."""
from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import TOP, assert_greedy_matches_hf, make_prompts
from tllm import LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams, SchedulerConfig

transformers = pytest.importorskip("transformers")

NUM_NEW = 10
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
            n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
            layers_block_type=["mamba", "attention", "mlp", "mamba", "mlp"],
            max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def save_tiny(path, seed: int = 0, **extra):
    config = transformers.NemotronHConfig(**{**TINY, **extra})
    config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).eval()
    with torch.no_grad():     # HF starts these at 1 and 0, which would hide a misplaced one
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".bias", ".D", ".dt_bias")):
                param.copy_(param.mean() + 0.2 * torch.randn_like(param))
            if ".experts" in name or name.endswith("gate.weight"):  # else they barely show
                param.mul_(10)
            if name.endswith(".A_log"):  # slow decay: a state left in a slot would show
                param.copy_((0.01 + 0.05 * torch.rand_like(param)).log())
        for name, buffer in model.named_buffers():   # the router's balancing bias
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


def test_greedy_matches_hf_in_continuous_batch(tmp_path):
    hf_model = save_tiny(tmp_path)
    prompts = make_prompts(TINY["vocab_size"])   # the last two share a prefix with the third
    max_tokens = [NUM_NEW - i % 3 for i in range(len(prompts))]   # finish at different steps
    with LLM(str(tmp_path), max_num_tokens=24, max_batch_size=3,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=TOP)
             for n in max_tokens],
            use_tqdm=False)
    assert_greedy_matches_hf(hf_model, prompts, outputs, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_answers(tmp_path, mode):
    """Swap: the state of a swapped-out request travels to the host and back into another
    slot (a slot's state left behind, or a reset one, changes the tokens: slow decay)."""
    hf_model = save_tiny(tmp_path, seed=1)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()
               for n in (20, 9, 31, 14, 25, 6)]
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION,
                             preemption_mode=mode)
    host = {"host_cache_size": 1 << 20} if mode == "swap" else {}
    with LLM(str(tmp_path), max_num_tokens=64, max_batch_size=4, scheduler_config=policy,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=48, **host)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=NUM_NEW, temperature=0,
                                              ignore_eos=True), use_tqdm=False)
        assert llm.get_kv_cache_stats()["preemptions"] > 0
        if mode == "swap":
            stats = llm.get_stats()
            assert stats["state_swapped_in"] == stats["state_swapped_out"] > 0
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW, logprobs=False)


def test_beam_search_refused(tmp_path):
    save_tiny(tmp_path)
    with LLM(str(tmp_path), max_batch_size=4,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256)) as llm:
        with pytest.raises(ValueError, match="state-space"):
            llm.generate({"prompt_token_ids": [5, 6, 7]},
                         SamplingParams(max_tokens=2, temperature=0, use_beam_search=True,
                                        best_of=2, n=1),
                         use_tqdm=False)


@pytest.mark.parametrize("latent", [None, 24])
def test_moe_blocks_match_hf(tmp_path, latent):
    """Nemotron 3's MoE blocks: grouped sigmoid routing with the correction bias, non-gated
    squared-ReLU experts stored one by one in the checkpoint, a shared expert; with and
    without the latent projection around the experts."""
    moe = dict(moe_latent_size=latent,
               layers_block_type=["mamba", "moe", "attention", "mamba", "moe"],
               n_routed_experts=8, moe_intermediate_size=32,
               moe_shared_expert_intermediate_size=48, num_experts_per_tok=2, n_group=2,
               topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    hf_model = save_tiny(tmp_path, seed=2, **moe)
    prompts = make_prompts(TINY["vocab_size"])[:6]
    with LLM(str(tmp_path), max_num_tokens=24, max_batch_size=3,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=NUM_NEW, temperature=0,
                                              ignore_eos=True, logprobs=TOP), use_tqdm=False)
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW)
