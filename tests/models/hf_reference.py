"""The HF transformers reference every parity test compares against: prompts of many lengths,
HF's greedy tokens and logprobs (fp32, CPU), and the checks that ours equal them."""
from __future__ import annotations

from collections.abc import Sequence

import torch

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


def assert_greedy_matches_hf(hf_model, prompts: Sequence[list[int]], outputs,
                             num_new: int | Sequence[int] = NUM_NEW, logprobs: bool = True):
    """Each output (a RequestOutput or its first CompletionOutput) holds HF's greedy tokens
    for its prompt, and, with `logprobs`, HF's top-TOP logprobs at every step."""
    counts = [num_new] * len(prompts) if isinstance(num_new, int) else list(num_new)
    assert len(outputs) == len(prompts) == len(counts)
    for index, (prompt, output, count) in enumerate(zip(prompts, outputs, counts)):
        completion = output.outputs[0] if hasattr(output, "outputs") else output
        want, want_logprobs = hf_greedy(hf_model, prompt, count)
        assert list(completion.token_ids) == want, f"prompt {index} ({len(prompt)} tokens)"
        if logprobs:
            check_logprobs(completion.logprobs, want_logprobs, want)


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
