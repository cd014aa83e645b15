"""Greedy tokens and logprobs equal HF transformers' (fp32, CPU) for each model family, with
prompts of many lengths sharing one continuous batch: chunked prefill, queued requests,
prefix reuse and small KV blocks all on at once."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_model
from tllm import LLM, KvCacheConfig, SamplingParams

NUM_NEW = 12
TOP = 5


def make_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 1, 25, 33, 60]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[2][:20] + [5, 6, 7])  # shares a 20-token prefix with prompt 2
    prompts.append(prompts[2])                   # identical to prompt 2 (prefix-cache hit)
    return prompts


def hf_greedy(model, prompt: list[int],
              num_new: int = NUM_NEW) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [step[0].float().log_softmax(-1) for step in out.logits]


def check_logprobs(ours, hf_logprobs, tokens):
    for step, (entry, ref) in enumerate(zip(ours, hf_logprobs)):
        top_vals, top_ids = ref.topk(TOP)
        for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert tid in entry, f"step {step}: HF top-{TOP} token {tid} missing"
            assert abs(entry[tid].logprob - val) < 1e-3
        assert abs(entry[tokens[step]].logprob - ref[tokens[step]].item()) < 1e-3


def generate_batch(path, prompts: list[list[int]], num_new: int = NUM_NEW, **params):
    """Our greedy completions of `prompts` in one continuous batch: a 24-token step budget
    (chunked prefill), 3 sequences at a time (queued requests), 4-token blocks (prefix
    reuse across prompts); every block is back in the pool afterwards."""
    params = SamplingParams(max_tokens=num_new, temperature=0, logprobs=TOP, **params)
    with LLM(str(path), max_num_tokens=24, max_batch_size=3,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert llm._engine.kv_cache.num_free_blocks == llm._engine.kv_cache.num_blocks
    return outputs


@pytest.mark.parametrize("arch", ["Llama", "Mistral", "Qwen2", "Qwen3"])
def test_greedy_matches_hf_in_continuous_batch(arch, tmp_path):
    hf_model = make_tiny_model(arch, tmp_path)
    prompts = make_prompts(hf_model.config.vocab_size)
    outputs = generate_batch(tmp_path, prompts)
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        check_logprobs(completion.logprobs, ref_logprobs, ref_tokens)


def test_prompt_logprobs_match_hf(tiny_llama):
    path, hf_model = tiny_llama
    prompt = make_prompts(hf_model.config.vocab_size)[2]
    with LLM(str(path), max_num_tokens=16,
             kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512)) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3),
                           use_tqdm=False)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-3
        assert len(entry) >= 3
