"""The LLM API on a tiny random Llama: input forms, sampling controls, streaming, abort,
errors, and KV accounting (every block back in the pool after each test)."""
from __future__ import annotations

import asyncio
import time

import pytest

from tllm import LLM, KvCacheConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT = [5, 17, 33, 2, 90, 41, 7]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), max_num_tokens=32, max_batch_size=4, max_seq_len=128,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        yield llm


@pytest.fixture(autouse=True)
def all_blocks_free_after(llm):
    yield
    kv = llm._engine.kv_cache
    for _ in range(100):  # an abort is applied by the loop thread shortly after
        if kv.num_free_blocks == kv.num_blocks:
            break
        time.sleep(0.01)
    assert kv.num_free_blocks == kv.num_blocks


def tokens(output, i=0):
    return output.outputs[i].token_ids


def test_input_forms_agree(llm):
    single = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    as_dict = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    batch = llm.generate([PROMPT, {"prompt_token_ids": PROMPT[:3]}], GREEDY, use_tqdm=False)
    assert tokens(single) == tokens(as_dict) == tokens(batch[0])
    assert single.prompt_token_ids == PROMPT
    assert len(tokens(single)) == 8 and single.outputs[0].finish_reason == "length"
    assert batch[1].prompt_token_ids == PROMPT[:3]


def test_per_prompt_sampling_params(llm):
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=3, temperature=0),
                                           SamplingParams(max_tokens=5, temperature=0)],
                        use_tqdm=False)
    assert [len(tokens(o)) for o in outs] == [3, 5]
    assert tokens(outs[1])[:3] == tokens(outs[0])


def test_n_samples_and_seeds(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=7)
    first = llm.generate(PROMPT, params, use_tqdm=False)
    again = llm.generate([PROMPT[:2], PROMPT], params, use_tqdm=False)[1]
    assert len(first.outputs) == 4
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    other = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=8),
                         use_tqdm=False)
    assert tokens(other) != tokens(first)


def test_n_samples_share_prompt_blocks(llm):
    kv = llm._engine.kv_cache
    prompt = list(range(10, 42))  # 8 full blocks of 4
    hits_before = _cached_blocks(kv)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=1.0, n=3, seed=1),
                       use_tqdm=False)
    assert len(out.outputs) == 3
    assert _cached_blocks(kv) >= hits_before + 7  # prompt blocks were published for reuse


def _cached_blocks(kv) -> int:
    return sum(1 for b in kv.pool.blocks if b.block_hash is not None)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = tokens(llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0),
                                 use_tqdm=False))
    stop = greedy[2]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0,
                                              stop_token_ids=[stop]), use_tqdm=False)
    cut = greedy.index(stop)
    assert tokens(out) == greedy[:cut + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    held = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, min_tokens=6,
                                               stop_token_ids=[stop]), use_tqdm=False)
    assert stop not in tokens(held)[:6]


def test_streaming_matches_generate(llm):
    expected = tokens(llm.generate(PROMPT, GREEDY, use_tqdm=False))

    async def stream():
        snapshots = []
        async for out in llm.generate_async(PROMPT, GREEDY, streaming=True):
            snapshots.append(list(out.outputs[0].token_ids_diff))
        final = await llm.generate_async(PROMPT, GREEDY)
        return snapshots, final

    snapshots, final = asyncio.run(stream())
    assert len(snapshots) > 1
    assert sum(snapshots, []) == expected == tokens(final)


def test_many_async_requests_share_batches(llm):
    async def run_all():
        results = [llm.generate_async(PROMPT[: i + 1], GREEDY) for i in range(7)]
        return await asyncio.gather(*results)

    outs = asyncio.run(run_all())
    for i, out in enumerate(outs):
        assert tokens(out) == tokens(llm.generate(PROMPT[: i + 1], GREEDY, use_tqdm=False))


def test_abort_frees_blocks(llm):
    async def abort_midway():
        result = llm.generate_async(PROMPT, SamplingParams(max_tokens=100, temperature=0,
                                                           ignore_eos=True), streaming=True)
        async for out in result:
            result.abort()
        return out

    out = asyncio.run(abort_midway())
    assert out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) < 100


@pytest.mark.parametrize("bad_input, match", [
    ([], "inputs"),
    ({"foo": 1}, "prompt"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
    ([[1, 2], [1, 10**6]], "vocabulary"),
    ([1] * 200, "max_seq_len"),
    ("text without a tokenizer", "tokenizer"),
])
def test_bad_inputs_raise_value_error(llm, bad_input, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(bad_input, GREEDY, use_tqdm=False)


def test_bad_sampling_params_argument(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([PROMPT, PROMPT], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPT, {"max_tokens": 3}, use_tqdm=False)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"dtype": "int8"}, "dtype"),
    ({"kv_cache_config": {"tokens_per_block": 0}}, "tokens_per_block"),
    ({"no_such_argument": 1}, "no_such_argument"),
])
def test_bad_llm_arguments(tiny_llama, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(str(tiny_llama[0]), **kwargs)


def test_request_larger_than_kv_cache(tiny_llama):
    with LLM(str(tiny_llama[0]), kv_cache_config=KvCacheConfig(tokens_per_block=4,
                                                               max_tokens=16)) as small:
        with pytest.raises(ValueError, match="KV blocks"):
            small.generate(PROMPT, SamplingParams(max_tokens=20), use_tqdm=False)


def test_shutdown_then_generate_raises(tiny_llama):
    llm = LLM(str(tiny_llama[0]), kv_cache_config=KvCacheConfig(max_tokens=256))
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)


def test_shutdown_releases_the_model_while_the_llm_is_held(tiny_llama):
    """A caller that keeps the closed LLM (a variable rebound only after the next LLM is
    built) must not keep its weights: on a GPU that was a second engine's out-of-memory."""
    import gc
    import weakref
    llm = LLM(str(tiny_llama[0]), kv_cache_config=KvCacheConfig(max_tokens=256))
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    weights = weakref.ref(next(llm._engine.executor.runner.model.parameters()))
    llm.shutdown()
    gc.collect()   # (shutdown collects itself on a GPU only)
    assert weights() is None


def test_process_that_never_shuts_down_exits_cleanly(tiny_llama):
    import subprocess
    import sys
    code = ("from tllm import LLM, SamplingParams, KvCacheConfig\n"
            f"llm = LLM({str(tiny_llama[0])!r}, kv_cache_config=KvCacheConfig(max_tokens=256))\n"
            "print(len(llm.generate([1, 2, 3], SamplingParams(max_tokens=4),"
            " use_tqdm=False).outputs[0].token_ids))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4"


def test_step_with_only_a_partial_prompt_chunk(llm):
    # a lone 100-token prompt under a 32-token budget: the first steps sample nothing
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    out = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(tokens(out)) == 8


def test_logit_bias_steers_greedy_choice(llm):
    forced = 123
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0,
                                              logit_bias={forced: 100.0}), use_tqdm=False)
    assert tokens(out) == [forced] * 4


def test_raw_deltas_match_generate_and_build_no_request_output(llm, monkeypatch):
    import tllm.llmapi.result as result_module
    params = SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=3, logprobs=1,
                            ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3]]
    expected = llm.generate(prompts, params, use_tqdm=False)
    made = []
    real = result_module.RequestOutput
    monkeypatch.setattr(result_module, "RequestOutput",
                        lambda *a, **kw: made.append(1) or real(*a, **kw))

    async def collect(result):
        return [delta async for delta in result.deltas()]

    async def run_both():
        results = await llm.submit_batch(prompts, [params] * 2, streaming=True)
        return await asyncio.gather(*(collect(r) for r in results))

    per_prompt = asyncio.run(run_both())
    assert made == []
    for deltas, output in zip(per_prompt, expected):
        for sample in output.outputs:
            mine = [d for d in deltas if d.index == sample.index]
            assert sum((d.token_ids for d in mine), []) == sample.token_ids
            # close, not equal: the two runs may batch the prompts into different steps,
            # and a matmul over another number of rows rounds in another order
            streamed = sum((d.logprobs for d in mine), [])
            assert [set(x) for x in streamed] == [set(x) for x in sample.logprobs]
            for got, want in zip(streamed, sample.logprobs):
                for token, logprob in want.items():
                    assert got[token].rank == logprob.rank
                    assert got[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)
            assert [d.finish_reason for d in mine].count("length") == 1
            assert mine[-1].finish_reason == "length"


def test_abort_through_raw_deltas_frees_blocks(llm):
    async def abort_midway():
        result = llm.generate_async(PROMPT, SamplingParams(max_tokens=100, temperature=0,
                                                           ignore_eos=True), streaming=True)
        deltas = []
        async for delta in result.deltas():
            deltas.append(delta)
            result.abort()
        return deltas

    deltas = asyncio.run(abort_midway())
    assert deltas[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas) < 100
