"""ProcessLLM, the engine in a process of its own: the same greedy tokens as an in-process LLM,
refused prompts raise the engine's ValueError (all or none), aborts free every KV block, and a
dead engine process shows as not alive."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.serve.helpers import wait_until_idle
from tllm import LLM, SamplingParams
from tllm.llmapi.process_llm import HEARTBEAT_S, EngineDeadError, ProcessLLM

KWARGS = dict(max_seq_len=128, max_batch_size=8, max_num_tokens=256)
PROMPTS = [[1, 5, 9, 200], [1, 7, 7, 7, 30, 2], [1, 300]]


@pytest.fixture(scope="module")
def process_llm(tiny_llama):
    llm = ProcessLLM(str(tiny_llama[0]), **KWARGS)
    yield llm
    llm.shutdown()


def run(coro):
    return asyncio.run(coro)


async def complete(llm, prompts, params) -> list:
    results = await llm.submit_batch([{"prompt_token_ids": p} for p in prompts],
                                     [params] * len(prompts))
    return [await r for r in results]


def test_same_greedy_tokens_as_in_process(process_llm, tiny_llama):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    theirs = run(complete(process_llm, PROMPTS, params))
    with LLM(str(tiny_llama[0]), **KWARGS) as local:
        ours = local.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                              use_tqdm=False)
        assert process_llm.sampling_defaults == local.sampling_defaults == {}  # none in file
    for remote, here in zip(theirs, ours):
        assert remote.outputs[0].token_ids == here.outputs[0].token_ids
        assert remote.outputs[0].finish_reason == here.outputs[0].finish_reason == "length"
        assert remote.outputs[0].logprobs[-1].keys() == here.outputs[0].logprobs[-1].keys()
        assert remote.metrics["num_output_tokens"] == 12


def test_streaming_and_n_samples(process_llm):
    params = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=1, ignore_eos=True)

    async def stream() -> tuple[int, object]:
        [result] = await process_llm.submit_batch([{"prompt_token_ids": PROMPTS[0]}],
                                                  [params], streaming=True)
        snapshots = [out async for out in result]
        return len(snapshots), snapshots[-1]

    num_snapshots, last = run(stream())
    assert num_snapshots > 1 and last.finished
    assert [len(o.token_ids) for o in last.outputs] == [6, 6, 6]
    wait_until_idle(process_llm)


def test_a_refused_prompt_raises_and_submits_nothing(process_llm):
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(complete(process_llm, [PROMPTS[0], [1, 10_000]], params))
    wait_until_idle(process_llm)
    assert len(run(complete(process_llm, [PROMPTS[1]], params))[0].outputs[0].token_ids) == 4


def test_abort_frees_every_block(process_llm):
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def abort_early():
        results = await process_llm.submit_batch([{"prompt_token_ids": p} for p in PROMPTS],
                                                 [params] * 3, streaming=True)
        async for _ in results[0]:
            break
        for result in results:
            result.abort()
        return [await r for r in results]

    outputs = run(abort_early())
    assert all(o.outputs[0].finish_reason == "abort" for o in outputs)
    assert all(len(o.outputs[0].token_ids) < 100 for o in outputs)
    wait_until_idle(process_llm)


def test_bad_arguments_fail_before_the_process_starts(tiny_llama):
    with pytest.raises(ValueError, match="max_batch_size"):
        ProcessLLM(str(tiny_llama[0]), max_batch_size=0)


def test_a_killed_engine_is_not_alive(tiny_llama):
    llm = ProcessLLM(str(tiny_llama[0]), **KWARGS)
    assert llm.is_alive
    os.kill(llm.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while llm.is_alive:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(EngineDeadError):
        run(complete(llm, [PROMPTS[0]], SamplingParams(max_tokens=2)))
    llm.shutdown()


def test_tensor_parallel_engine_process(tiny_llama, process_llm):
    """The engine process starts its own worker ranks (gloo on the CPU)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = run(complete(process_llm, PROMPTS[:1], params))[0].outputs[0].token_ids
    with ProcessLLM(str(tiny_llama[0]), tensor_parallel_size=2, device="cpu",
                    **KWARGS) as llm:
        assert run(complete(llm, PROMPTS[:1], params))[0].outputs[0].token_ids == expected


def test_a_caller_cancelled_while_submitting_leaves_nothing_running(process_llm):
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def cancel_submission() -> None:
        task = asyncio.ensure_future(process_llm.submit_batch(
            [{"prompt_token_ids": p} for p in PROMPTS], [params] * 3))
        await asyncio.sleep(0)      # the submission is sent, not yet accepted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    steps_before = process_llm.get_stats()["num_steps"]
    run(cancel_submission())
    wait_until_idle(process_llm)
    time.sleep(3 * HEARTBEAT_S)     # the stats that follow the last step
    assert process_llm.get_stats()["num_steps"] - steps_before < 50   # not 100 decode steps


def test_light_handles_relay_the_engines_deltas(process_llm):
    from tllm.llmapi.result import DeltaStream, GenerationResult
    params = SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=2, logprobs=1,
                            ignore_eos=True)

    async def stream():
        results = await process_llm.submit_batch([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                                                 [params] * 2, streaming=True)
        assert all(type(r) is DeltaStream and not isinstance(r, GenerationResult)
                   for r in results)

        async def collect(result):
            return [delta async for delta in result.deltas()]

        per_prompt = await asyncio.gather(*(collect(r) for r in results))
        return per_prompt, results

    per_prompt, results = run(stream())
    assert all(r.finished for r in results)
    assert not process_llm._engine.streams  # every finished handle is forgotten
    for deltas in per_prompt:
        for index in range(2):
            mine = [d for d in deltas if d.index == index]
            assert sum(len(d.token_ids) for d in mine) == 5
            assert sum(len(d.logprobs) for d in mine) == 5
            assert mine[-1].finish_reason == "length"
            assert mine[-1].metrics["num_output_tokens"] == 5
    wait_until_idle(process_llm)


def test_a_model_without_a_tokenizer_has_none_here(process_llm):
    assert process_llm.tokenizer is None        # (the engine sent None, pickled)


def test_relay_sends_deltas_as_they_are_and_errors_that_pickle():
    import queue
    import threading
    from tllm.llmapi.engine_process import _Relay
    from tllm.outputs import CompletionDelta
    sink, finished = queue.SimpleQueue(), queue.SimpleQueue()
    relay = _Relay("r1", 2, sink, finished)
    first = CompletionDelta(0, [5], "x")
    relay(first)
    relay(CompletionDelta(1, [], "", finish_reason="length"))
    assert finished.empty()                     # sample 0 is still running
    unpicklable = RuntimeError(threading.Lock())
    last = CompletionDelta(0, [], "", finish_reason="abort", error=unpicklable)
    relay(last)
    sent = [sink.get_nowait() for _ in range(3)]
    assert sent[0] == ("r1", first) and sent[0][1] is first
    assert sent[2][1] is last and last.error is not unpicklable
    assert "RuntimeError" in str(last.error)
    assert finished.get_nowait() == "r1"


def test_aborts_of_one_event_loop_turn_are_one_message(process_llm):
    """A burst of disconnects costs the engine one pipe message, and each stream is aborted
    once however often its handle is told to."""
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    sent: list[tuple] = []

    async def abort_all() -> list:
        engine = process_llm._engine
        send = engine.send
        engine.send = lambda message: (sent.append(message), send(message))
        try:
            results = await process_llm.submit_batch(
                [{"prompt_token_ids": p} for p in PROMPTS], [params] * 3, streaming=True)
            for result in results + results:
                result.abort()
            await asyncio.sleep(0)
        finally:
            del engine.send
        return [await r for r in results]

    outputs = run(abort_all())
    assert [m[0] for m in sent] == ["submit", "abort"] and len(sent[1][1]) == 3
    assert all(o.outputs[0].finish_reason == "abort" for o in outputs)
    wait_until_idle(process_llm)


def test_open_requests_of_a_killed_engine_fail_and_restart_brings_it_back(tiny_llama):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=120, ignore_eos=True)
    with ProcessLLM(str(tiny_llama[0]), **KWARGS) as llm:
        expected = run(complete(llm, PROMPTS[:1], params))[0].outputs[0].token_ids

        async def kill_while_streaming() -> None:
            [result] = await llm.submit_batch([{"prompt_token_ids": PROMPTS[0]}], [long],
                                              streaming=True)
            with pytest.raises(EngineDeadError, match="exited with code -9"):
                async for _ in result.deltas():
                    os.kill(llm.pid, signal.SIGKILL)

        run(kill_while_streaming())
        old_pid = llm.pid
        llm.restart()
        assert llm.is_alive and llm.pid != old_pid
        assert run(complete(llm, PROMPTS[:1], params))[0].outputs[0].token_ids == expected
