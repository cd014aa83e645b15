"""Text features on the real default model (SmolLM2): stop strings, streaming text, chat."""
from __future__ import annotations

import asyncio

import pytest

from tllm import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2", max_seq_len=512) as llm:
        yield llm
        kv = llm._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks


def greedy(max_tokens=24, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def test_stop_string_ends_generation_and_is_cut(llm):
    full = llm.generate(PROMPT, greedy(), use_tqdm=False).outputs[0].text
    stop = full.split()[2]  # a word from the middle of the greedy answer
    cut = full.index(stop)
    out = llm.generate(PROMPT, greedy(stop=[stop, "never appears"]), use_tqdm=False).outputs[0]
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPT, greedy(stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False).outputs[0]
    assert kept.text == full[:cut + len(stop)]


def test_streamed_text_equals_generated_text(llm):
    prompts = [PROMPT, "Write the word 'café' and an emoji: ", "日本の首都は"]
    for prompt in prompts:
        expected = llm.generate(prompt, greedy(stop="zz"), use_tqdm=False).outputs[0].text

        async def stream():
            pieces = []
            async for out in llm.generate_async(prompt, greedy(stop="zz"), streaming=True):
                pieces.append(out.outputs[0].text_diff)
            return pieces

        pieces = asyncio.run(stream())
        assert "".join(pieces) == expected
        assert not any("\ufffd" in p for p in pieces)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   greedy(max_tokens=16), use_tqdm=False)
    assert out.prompt_token_ids[0] == 1  # <|im_start|>
    assert "Paris" in out.outputs[0].text


def test_text_prompt_is_tokenized_like_hf(llm):
    out = llm.generate(PROMPT, greedy(max_tokens=1), use_tqdm=False)
    assert out.prompt == PROMPT
    assert out.prompt_token_ids == llm.tokenizer.hf(PROMPT).input_ids


def test_raw_deltas_carry_the_generated_text(llm):
    """Each sample's deltas add up to its token ids and to their detokenized text. (Compared
    within one run: another run of the same seeded request may sample differently, as the
    CPU's int8 kernels round differently with the number of rows in a step.)"""
    params = SamplingParams(max_tokens=16, temperature=0.8, n=2, seed=5, logprobs=0)
    prompts = [PROMPT, "日本の首都は"]

    async def collect(result):
        return [delta async for delta in result.deltas()]

    async def stream():
        results = await llm.submit_batch(prompts, [params] * 2, streaming=True)
        return await asyncio.gather(*(collect(r) for r in results))

    for deltas in asyncio.run(stream()):
        assert {d.index for d in deltas} == {0, 1}
        for index in (0, 1):
            mine = [d for d in deltas if d.index == index]
            token_ids = sum((d.token_ids for d in mine), [])
            assert mine[-1].finish_reason is not None and len(token_ids) > 0
            # (a sample cut by max_tokens inside a character leaves those bytes out of its
            # text, as streaming never sends half a character; a full decode shows U+FFFD)
            assert "".join(d.text for d in mine) == llm.tokenizer.decode(token_ids).rstrip(
                "\ufffd")
            assert all(len(d.logprobs) == len(d.token_ids) for d in mine)
