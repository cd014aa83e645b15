"""SamplingParams.logprobs_mode against HF transformers on a tiny random Llama (fp32, CPU):
the logprobs of each generated token (and the top ones) equal log_softmax of HF's logits
after HF's own warpers (temperature; top-k and top-p for processed_logprobs), and prompt
logprobs come in the same call."""
from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from tllm import LLM, KvCacheConfig, SamplingParams

PROMPT = [5, 17, 33, 9, 90, 41, 7]
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(str(tiny_llama[0]), max_num_tokens=64, max_batch_size=4, max_seq_len=128,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        yield llm


def _hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def _expected(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log_softmax of one position's logits as the request's mode says (HF's warpers)."""
    scores = logits[None]
    if params.logprobs_mode != "raw_logprobs":
        temperature = params.temperature or 1.0
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if params.logprobs_mode == "processed_logprobs":
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores[0].log_softmax(dim=-1)


def _check_output(model, output, params: SamplingParams) -> None:
    tokens = output.outputs[0].token_ids
    logits = _hf_logits(model, PROMPT + tokens)[len(PROMPT) - 1:-1]
    for position, (token, entry) in enumerate(zip(tokens, output.outputs[0].logprobs)):
        expected = _expected(logits[position], params)
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=TOL)
        assert torch.isfinite(expected[token])  # the token was drawn from this distribution
        top = expected.topk(params.logprobs)
        for value, token_id in zip(top.values.tolist(), top.indices.tolist()):
            assert entry[token_id].logprob == pytest.approx(value, abs=TOL)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=6, temperature=0, logprobs=3),
    SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3, logprobs=3,
                   logprobs_mode="tempered_logprobs"),
    SamplingParams(max_tokens=6, temperature=0.7, top_k=20, top_p=0.9, seed=3, logprobs=3,
                   logprobs_mode="processed_logprobs"),
    SamplingParams(max_tokens=6, temperature=1.3, top_p=0.5, seed=5, logprobs=2,
                   logprobs_mode="processed_logprobs"),
    SamplingParams(max_tokens=6, temperature=0, top_k=5, logprobs=2,
                   logprobs_mode="processed_logprobs"),
], ids=["raw-greedy", "tempered", "processed-topk-topp", "processed-topp", "processed-greedy"])
def test_logprobs_follow_the_mode(llm, tiny_llama, params):
    params.ignore_eos = True
    _check_output(tiny_llama[1], llm.generate(PROMPT, params, use_tqdm=False), params)


def test_modes_share_a_batch(llm, tiny_llama):
    modes = ("raw_logprobs", "tempered_logprobs", "processed_logprobs")
    params = [SamplingParams(max_tokens=4, temperature=0.8, top_k=10, seed=i, logprobs=2,
                             logprobs_mode=mode, ignore_eos=True)
              for i, mode in enumerate(modes)]
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    for output, p in zip(outputs, params):
        _check_output(tiny_llama[1], output, p)


def test_prompt_logprobs_in_the_same_call(llm, tiny_llama):
    params = SamplingParams(max_tokens=3, temperature=0.9, top_p=0.8, seed=1, logprobs=2,
                            prompt_logprobs=2, logprobs_mode="processed_logprobs",
                            ignore_eos=True)
    output = llm.generate(PROMPT, params, use_tqdm=False)
    _check_output(tiny_llama[1], output, params)
    raw = _hf_logits(tiny_llama[1], PROMPT).log_softmax(dim=-1)  # prompts: the model's own
    assert output.prompt_logprobs[0] is None
    for i, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry[PROMPT[i]].logprob == pytest.approx(float(raw[i - 1, PROMPT[i]]), abs=TOL)


def test_bad_mode_raises():
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="processed_logits")
