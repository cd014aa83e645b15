"""Deltas are built once, from the Request, on the executor's side (DeltaBuilder), and reach
the caller unchanged: raw through deltas(), or folded into cumulative RequestOutputs only when
awaited / iterated. Requests are driven by hand here, as the executor drives them."""
from __future__ import annotations

import asyncio

import pytest

import tllm.llmapi.result as result_module
from tllm.llmapi.result import DeltaBuilder, GenerationResult
from tllm.outputs import Logprob
from tllm.request import FinishReason, Request
from tllm.sampling_params import SamplingParams

PROMPT = [1, 2, 3]


class FakeDetokenizer:
    """What the delta reads of a detokenizer: the text so far, and how much of it may be
    streamed (the rest is held back, e.g. a possible stop string). The tests write both;
    decoding (which the delta builder asks for, for requests without stop strings) and
    finalizing change nothing here."""

    def __init__(self) -> None:
        self.text = ""
        self.stream_len = 0

    def add_token(self, token: int, check_stop: bool = True) -> None:
        pass

    def finalize(self) -> None:
        pass


def make_requests(params: SamplingParams) -> list[Request]:
    return [Request(request_id=f"r-{i}", prompt_token_ids=PROMPT, sampling_params=params,
                    max_new_tokens=100, sample_index=i, detokenizer=FakeDetokenizer())
            for i in range(params.n)]


def step(request: Request, token: int, text: str, hold_back: int = 0) -> None:
    """What the executor does for one sampled token, then its on_update call."""
    request.num_computed_tokens = request.num_tokens
    request.append_token(token)
    if request.sampling_params.logprobs is not None:
        request.output_logprobs.append({token: Logprob(-0.25 * token, 1)})
        request.cumulative_logprob += -0.25 * token
    request.detokenizer.text += text
    request.detokenizer.stream_len = len(request.detokenizer.text) - hold_back
    request.on_update(request)


def finish(request: Request, reason=FinishReason.LENGTH, error: Exception | None = None):
    request.error = error
    request.finish(reason)
    request.detokenizer.stream_len = len(request.detokenizer.text)   # finalize()
    request.on_update(request)


def submit(params: SamplingParams, streaming: bool = True):
    """A GenerationResult bound to hand-driven requests; every delta built is recorded."""
    requests = make_requests(params)
    result = GenerationResult("7", None, PROMPT, params, streaming)
    built = []

    def on_delta(delta):
        built.append(delta)
        result.post(delta)

    result_module.bind_deltas(requests, on_delta)
    return result, requests, built


async def drain(result) -> list:
    return [delta async for delta in result.deltas()]


def test_each_update_makes_one_delta_that_reaches_the_caller_unchanged():
    async def main():
        result, [request], built = submit(SamplingParams())
        step(request, 5, "a")
        step(request, 6, "b")
        finish(request)
        return built, await drain(result), result

    built, received, result = asyncio.run(main())
    assert len(built) == 3
    assert all(got is sent for got, sent in zip(received, built, strict=True))
    assert [d.token_ids for d in received] == [[5], [6], []]
    assert received[-1].finish_reason == "length" and result.finished
    assert received[-1].metrics["num_output_tokens"] == 2


def test_streamed_text_equals_the_final_text_with_held_back_text():
    async def main():
        result, [request], _ = submit(SamplingParams())
        step(request, 5, "ab", hold_back=1)     # "b" might start a stop string
        step(request, 6, "cd", hold_back=2)
        step(request, 7, "e")
        finish(request, FinishReason.STOP)
        return [d.text for d in await drain(result)], request.detokenizer.text

    pieces, final = asyncio.run(main())
    assert pieces == ["a", "b", "cde", ""]
    assert "".join(pieces) == final == "abcde"


def test_cumulative_outputs_are_folded_from_the_deltas():
    async def main():
        result, [request], _ = submit(SamplingParams())
        step(request, 5, "x")
        step(request, 6, "y")
        finish(request)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].text_diff,
                 o.outputs[0].token_ids_diff, o.finished) async for o in result]

    assert asyncio.run(main()) == [([5], "x", "x", [5], False), ([5, 6], "xy", "y", [6], False),
                                   ([5, 6], "xy", "", [], True)]


def test_deltas_build_no_request_output(monkeypatch):
    made = []
    real = result_module.RequestOutput
    monkeypatch.setattr(result_module, "RequestOutput",
                        lambda *a, **kw: made.append(1) or real(*a, **kw))

    async def run(consume):
        result, [request], _ = submit(SamplingParams())
        step(request, 5, "x")
        finish(request)
        return await consume(result)

    asyncio.run(run(drain))
    assert made == []
    output = asyncio.run(run(lambda r: r.aresult()))
    assert made == [1] and output.outputs[0].token_ids == [5]


def test_samples_interleave_with_their_own_logprobs():
    params = SamplingParams(n=2, logprobs=1)

    async def main():
        result, (first, second), _ = submit(params)
        step(first, 10, "a")
        step(second, 20, "b")
        step(second, 21, "c")
        step(first, 11, "d")
        finish(second)
        finish(first)
        deltas = await drain(result)
        return deltas

    deltas = asyncio.run(main())
    assert [(d.index, d.token_ids) for d in deltas] == [
        (0, [10]), (1, [20]), (1, [21]), (0, [11]), (1, []), (0, [])]
    for d in deltas:   # each delta's logprobs are those of its own new tokens
        assert [list(p) for p in d.logprobs] == [[t] for t in d.token_ids]
    assert deltas[-2].cumulative_logprob == pytest.approx(-0.25 * (20 + 21))
    assert deltas[-1].cumulative_logprob == pytest.approx(-0.25 * (10 + 11))


def test_no_logprobs_unless_asked():
    async def main():
        result, [request], _ = submit(SamplingParams())
        step(request, 5, "x")
        finish(request)
        return await drain(result)

    assert all(d.logprobs is None and d.cumulative_logprob is None for d in asyncio.run(main()))


def test_prompt_logprobs_arrive_once():
    params = SamplingParams(n=2, prompt_logprobs=1)
    prompt_logprobs = [None, {2: Logprob(-1.0, 1)}, {3: Logprob(-2.0, 1)}]

    async def main():
        result, requests, _ = submit(params)
        for request in requests:
            request.prompt_logprobs = list(prompt_logprobs)
        for token in (5, 6):
            for request in requests:
                step(request, token, "t")
        for request in requests:
            finish(request)
        deltas = await drain(result)
        return deltas

    deltas = asyncio.run(main())
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0] and carrying[0].index == 0
    assert carrying[0].prompt_logprobs == prompt_logprobs


def test_a_request_failing_midway_raises_after_its_last_delta():
    async def main():
        result, [request], _ = submit(SamplingParams())
        step(request, 5, "x")
        finish(request, FinishReason.ABORT, error=ValueError("step failed"))
        received = []
        with pytest.raises(RuntimeError, match="request 7 failed: step failed"):
            async for delta in result.deltas():
                received.append(delta)
        return received

    received = asyncio.run(main())
    assert [d.token_ids for d in received] == [[5], []]
    assert received[-1].finish_reason == "abort" and isinstance(received[-1].error, ValueError)


def test_a_failed_request_raises_when_awaited():
    async def main():
        result, [request], _ = submit(SamplingParams(), streaming=False)
        finish(request, FinishReason.ABORT, error=ValueError("step failed"))
        await result

    with pytest.raises(RuntimeError, match="step failed"):
        asyncio.run(main())


def test_delta_builder_hands_out_each_token_once():
    params = SamplingParams(logprobs=0)
    [request] = make_requests(params)
    builder = DeltaBuilder()
    request.on_update = lambda r: None
    step(request, 5, "a")
    step(request, 6, "b")
    first = builder.build(request)
    again = builder.build(request)
    assert first.token_ids == [5, 6] and first.text == "ab" and len(first.logprobs) == 2
    assert again.token_ids == [] and again.text == "" and again.logprobs == []
