"""N-gram speculation on SmolLM2 (its GGUF weights): an input-grounded task gives the same
greedy text as the engine without speculation, with drafts accepted; streaming deltas add up
to the final text; a stop string ends both at the same place; logprobs of accepted tokens
match the plain engine's.

Both engines run SmolLM2's weights dense in float32 (`quantization="none"`): verification
batches a request's rows differently from plain decoding, and under the int8 default's bf16
products (logits rounded to 0.125 at SmolLM2's magnitudes) this task's near-tie at token 9
(0.03 apart) goes either way (README, The CPU path: batch invariance). In float32 the two
differ by ~1e-6, so the greedy tokens must agree."""
from __future__ import annotations

import asyncio

import pytest

from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.config import NGramDecodingConfig

TASK = ("Copy this list exactly, one item per line: apples, pears, plums, cherries, "
        "grapes, lemons, limes, melons.")


def engine(spec: bool) -> LLM:
    extra = {"speculative_config": NGramDecodingConfig(max_draft_len=4)} if spec else {}
    return LLM("smollm2", quantization="none", max_seq_len=256, max_num_tokens=64,
               kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=2048), **extra)


def prompt_of(llm: LLM) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": TASK}])


def stream_text(llm: LLM, prompt: str, params: SamplingParams) -> tuple[str, str]:
    async def collect():
        parts, final = [], None
        async for output in llm.generate_async(prompt, params, streaming=True):
            parts.append(output.outputs[0].text_diff)
            final = output
        return "".join(parts), final.outputs[0].text
    return asyncio.run(collect())


@pytest.fixture(scope="module")
def plain_and_spec():
    plain, spec = engine(False), engine(True)
    yield plain, spec
    for llm in (plain, spec):
        kv = llm._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        llm.shutdown()


def test_smollm2_greedy_text_identical_with_logprobs(plain_and_spec):
    plain, spec = plain_and_spec
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=2)
    prompt = prompt_of(plain)
    ref = plain.generate(prompt, params, use_tqdm=False).outputs[0]
    out = spec.generate(prompt, params, use_tqdm=False).outputs[0]
    assert out.token_ids == ref.token_ids
    assert spec.get_stats()["spec_accepted_tokens"] > 0
    for ours, theirs, token in zip(out.logprobs, ref.logprobs, ref.token_ids):
        assert abs(ours[token].logprob - theirs[token].logprob) < 1e-3
    assert len(out.logprobs) == len(ref.token_ids)


def test_smollm2_streaming_and_stop_string(plain_and_spec):
    plain, spec = plain_and_spec
    prompt = prompt_of(plain)
    ref = plain.generate(prompt, SamplingParams(max_tokens=32, temperature=0),
                         use_tqdm=False).outputs[0].text
    stop = "Pears, Pears"
    assert stop in ref
    params = SamplingParams(max_tokens=32, temperature=0, stop=[stop])
    streamed, final = stream_text(spec, prompt, params)
    assert streamed == final == ref[:ref.index(stop)]
