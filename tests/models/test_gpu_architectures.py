"""On a GPU: every architecture of this round runs the CUDA path (Triton attention, the fused
MoE kernels, CUDA graphs for decode) and gives HF transformers' greedy tokens (fp32 on both
sides; HF on the CPU). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import hf_greedy, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_NEW = 12


def _make(arch: str, path):
    from tests.models.test_dense_parity import save_tiny
    from tests.models.test_gemma_parity import make_tiny_gemma
    from tests.models.test_moe_parity import make_tiny_moe
    from tests.models.test_transformers_fallback import make_model
    if arch in ("Mixtral", "Qwen2Moe", "Qwen3Moe"):
        return make_tiny_moe(arch, path)
    if arch in ("Gemma2", "Gemma3"):
        return make_tiny_gemma(arch, path)
    if arch in ("Starcoder2", "Cohere2"):
        return make_model(arch, path)
    return save_tiny(arch, path)


@pytest.mark.parametrize("arch", ["Mixtral", "Qwen2Moe", "Qwen3Moe", "Gemma2", "Gemma3",
                                  "Phi3", "GPTNeoX", "Olmo2", "Starcoder2", "Cohere2"])
def test_cuda_greedy_matches_hf(arch, tmp_path):
    hf_model = _make(arch, tmp_path)
    prompts = make_prompts(hf_model.config.vocab_size)
    if arch == "Phi3":  # longrope: HF's rotation is ours only within the original length
        limit = hf_model.config.rope_parameters["original_max_position_embeddings"]
        prompts = [p for p in prompts if len(p) + NUM_NEW <= limit]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), device="cuda", dtype="float32", max_num_tokens=24,
             max_batch_size=4, max_seq_len=128,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert llm._engine.kv_cache.num_free_blocks == llm._engine.kv_cache.num_blocks
    mismatched = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        ref, _ = hf_greedy(hf_model, prompt, NUM_NEW)
        ours = list(output.outputs[0].token_ids)
        if ours[:len(ref)] != ref:  # HF stops at an end-of-sequence token; we go on
            mismatched.append((i, ours, ref))
    assert not mismatched, mismatched
