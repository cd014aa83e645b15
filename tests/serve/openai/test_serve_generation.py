"""Generation, the server's side of one API request: the engine's deltas pass through as they
are (no diffing, no RequestOutput), with their choice index; several prompts x n samples
interleave; non-streamed choices are folded from the deltas; metrics are tracked per delta;
a failure midway raises after what came before; closing aborts what is unfinished."""
from __future__ import annotations

import asyncio

import pytest

import tllm.llmapi.result as result_module
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.outputs import CompletionDelta, Logprob
from tllm.serve.openai.generation import EngineClient, Generation, PromptInput
from tllm.serve.http.metrics import ServerMetrics


class Handle:
    """An engine handle on one prompt whose deltas the test feeds by hand."""

    def __init__(self, num_samples: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_unfinished = num_samples
        self.num_aborts = 0

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def abort(self) -> None:
        self.num_aborts += 1

    def feed(self, *deltas) -> None:
        for delta in deltas:
            self.queue.put_nowait(delta)

    async def deltas(self):
        while not self.finished:
            delta = await self.queue.get()
            if isinstance(delta, Exception):
                raise delta
            if delta.finished:
                self.num_unfinished -= 1
            yield delta


class Tracker:
    """Records what Generation tells the metrics."""

    def __init__(self) -> None:
        self.calls = []

    def on_tokens(self, seq, num_tokens):
        self.calls.append(("tokens", seq, num_tokens))

    def on_finish(self, seq, reason):
        self.calls.append(("finish", seq, reason))

    def on_engine_metrics(self, metrics):
        self.calls.append(("engine", metrics["queue_s"]))

    def close(self):
        self.calls.append(("close",))


def token(index, token_id, **kw) -> CompletionDelta:
    return CompletionDelta(index, [token_id], chr(token_id), **kw)


def end(index, reason="length", queue_s=0.0, **kw) -> CompletionDelta:
    return CompletionDelta(index, [], "", finish_reason=reason, metrics={"queue_s": queue_s},
                           **kw)


def test_engine_deltas_pass_through_unchanged_with_their_choice_index():
    async def main():
        handles = [Handle(2), Handle(2)]
        sent = [token(0, 97), token(1, 98), token(0, 99), end(1), end(0), end(0), end(1)]
        owners = [0, 1, 1, 0, 1, 0, 1]      # the prompt each delta belongs to, in order
        generation = Generation(handles, 2, Tracker())
        for delta, owner in zip(sent, owners):
            handles[owner].feed(delta)
        received = [seq async for seq in generation.deltas()]
        return sent, owners, received

    sent, owners, received = asyncio.run(main())
    # one prompt's deltas keep their order; every one arrives once, as the engine made it
    for owner in (0, 1):
        theirs = [d for d, o in zip(sent, owners) if o == owner]
        assert [s.engine for s in received if s.prompt_index == owner] == theirs
        assert all(s.engine is d for s, d in zip(
            [s for s in received if s.prompt_index == owner], theirs))
    assert len(received) == len(sent)
    for seq in received:
        assert seq.index == seq.prompt_index * 2 + seq.engine.index
        assert (seq.text, seq.token_ids, seq.finish_reason) == (
            seq.engine.text, seq.engine.token_ids, seq.engine.finish_reason)


def test_wait_folds_each_choice_with_its_logprobs_and_prompt_logprobs():
    prompt_logprobs = [None, {5: Logprob(-1.0, 1)}]

    async def main():
        handles = [Handle(2), Handle(1)]
        generation = Generation(handles, 2, Tracker())
        handles[0].feed(token(1, 100, logprobs=[{100: Logprob(-0.1, 1)}]),
                        token(0, 101, logprobs=[{101: Logprob(-0.2, 1)}],
                              prompt_logprobs=prompt_logprobs),
                        token(0, 102, logprobs=[{102: Logprob(-0.3, 1)}]),
                        end(0, "stop", logprobs=[]), end(1, logprobs=[]))
        handles[1].feed(token(0, 103), end(0))
        choices = await generation.wait()
        return choices, generation

    choices, generation = asyncio.run(main())
    assert [(c.index, c.prompt_index) for c in choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [c.text for c in choices] == ["ef", "d", "g", ""]
    assert [c.token_ids for c in choices] == [[101, 102], [100], [103], []]
    assert [list(p) for p in choices[0].logprobs] == [[101], [102]]
    assert [list(p) for p in choices[1].logprobs] == [[100]]
    assert choices[2].logprobs is None          # not asked for
    assert [c.finish_reason for c in choices[:3]] == ["stop", "length", "length"]
    assert generation.prompt_logprobs == [prompt_logprobs, None]


def test_metrics_are_tracked_per_delta():
    async def main():
        handle = Handle(2)
        tracker = Tracker()
        generation = Generation([handle], 2, tracker)
        handle.feed(token(0, 97), token(1, 98), end(1, queue_s=1.0), end(0, queue_s=0.5))
        async with generation:
            await generation.wait()
        return tracker.calls

    # the prompt's engine metrics are sample 0's, told at each finish once it has come
    assert asyncio.run(main()) == [("tokens", 0, 1), ("tokens", 1, 1), ("tokens", 1, 0),
                                   ("finish", 1, "length"), ("tokens", 0, 0),
                                   ("finish", 0, "length"), ("engine", 0.5), ("close",)]


def test_a_failure_midway_raises_after_the_deltas_before_it():
    async def main():
        handle = Handle(1)
        generation = Generation([handle], 1, Tracker())
        handle.feed(token(0, 97), RuntimeError("step failed"))
        received = []
        with pytest.raises(RuntimeError, match="step failed"):
            async for seq in generation.deltas():
                received.append(seq.text)
        return received

    assert asyncio.run(main()) == ["a"]


def test_closing_aborts_only_what_is_unfinished():
    async def main():
        done, running = Handle(1), Handle(1)
        generation = Generation([done, running], 1, Tracker())
        done.feed(token(0, 97), end(0))
        running.feed(token(0, 98))
        async with generation:
            seen = 0
            async for _ in generation.deltas():
                seen += 1
                if seen == 3:
                    break
        return done.num_aborts, running.num_aborts

    assert asyncio.run(main()) == (0, 1)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    with LLM(str(tiny_llama[0]), max_seq_len=128, max_batch_size=8,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        yield llm


def test_the_server_path_builds_no_request_output(tiny, monkeypatch):
    made = []
    real = result_module.RequestOutput
    monkeypatch.setattr(result_module, "RequestOutput",
                        lambda *a, **kw: made.append(1) or real(*a, **kw))
    params = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=4, logprobs=1,
                            ignore_eos=True)
    prompts = [PromptInput([1, 5, 9]), PromptInput([1, 7, 7, 30])]

    async def serve(stream: bool):
        engine = EngineClient(tiny, ServerMetrics("tiny", tiny.get_stats), None, 60.0)
        generation = await engine.start(prompts, [params] * 2, arrival=0.0)
        async with generation:
            if stream:
                return [seq async for seq in generation.deltas()]
            return await generation.wait()

    streamed = asyncio.run(serve(stream=True))
    choices = asyncio.run(serve(stream=False))
    assert made == []
    expected = tiny.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params,
                             use_tqdm=False)
    samples = [s for output in expected for s in output.outputs]
    assert [c.token_ids for c in choices] == [s.token_ids for s in samples]
    assert [c.logprobs for c in choices] == [s.logprobs for s in samples]
    for index, sample in enumerate(samples):
        mine = [seq for seq in streamed if seq.index == index]
        assert sum((seq.token_ids for seq in mine), []) == sample.token_ids
        assert mine[-1].finish_reason == "length"
