"""Beam search equals HF transformers' generate(num_beams=B) (tokens and scores), mixed with
ordinary requests, under preemption, with every KV block free afterwards; best_of sampling
returns the n best of its samples."""
from __future__ import annotations

import pytest
import torch

from tllm import (LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams,
                  SchedulerConfig)

# Tokens the tiny model likes (seen in its beams): as stop tokens, they end hypotheses early.
STOPS = [76, 101, 272]
EOS = 2
MAX_NEW = 10
# (beam width, n, length_penalty, early_stopping)
CASES = [(2, 2, 1.0, False), (2, 1, 0.0, True), (4, 3, 1.0, True), (4, 2, 2.0, "never"),
         (4, 4, -1.0, False), (4, 1, 1.0, "never")]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (13, 7, 21)]


def beam_params(width, n, length_penalty, early_stopping, **kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0,
                          max_tokens=MAX_NEW, length_penalty=length_penalty,
                          early_stopping=early_stopping, stop_token_ids=STOPS, **kw)


# HF's beams per (model, prompt, case): the preemption tests check the same jobs as the
# mixed batch, and HF's beam search on a CPU is most of these tests' time.
_HF_BEAMS: dict[tuple, list[tuple[list[int], float]]] = {}


def hf_beams(model, prompt, width, n, length_penalty, early_stopping):
    """HF's n best: (output tokens up to and with the stop token, sequence score)."""
    key = (id(model), tuple(prompt), width, n, length_penalty, early_stopping)
    if key not in _HF_BEAMS:
        _HF_BEAMS[key] = _run_hf_beams(model, prompt, width, n, length_penalty,
                                       early_stopping)
    return _HF_BEAMS[key]


def _run_hf_beams(model, prompt, width, n, length_penalty, early_stopping):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n,
                             do_sample=False, length_penalty=length_penalty,
                             early_stopping=early_stopping, max_new_tokens=MAX_NEW,
                             eos_token_id=[EOS] + STOPS, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores):
        tokens = sequence[len(prompt):].tolist()
        ends = [i for i, t in enumerate(tokens) if t in [EOS] + STOPS]
        beams.append((tokens[:ends[0] + 1] if ends else tokens, float(score)))
    return beams


def assert_equals_hf(model, jobs, outputs) -> None:
    for (prompt, (width, n, lp, es)), output in zip(jobs, outputs):
        expected = hf_beams(model, prompt, width, n, lp, es)
        got = [(o.token_ids, o.cumulative_logprob / len(o.token_ids) ** lp)
               for o in output.outputs]
        assert [t for t, _ in got] == [t for t, _ in expected], (width, n, lp, es)
        for (_, ours), (_, theirs) in zip(got, expected):
            assert ours == pytest.approx(theirs, abs=1e-4)
        assert all(o.finish_reason in ("stop", "length") for o in output.outputs)


def all_jobs(vocab):
    return [(p, case) for p in prompts(vocab) for case in CASES]


def run_jobs(llm, jobs, extra=()):
    inputs = [{"prompt_token_ids": p} for p, _ in jobs] + [{"prompt_token_ids": p}
                                                          for p, _ in extra]
    params = [beam_params(*case) for _, case in jobs] + [sp for _, sp in extra]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    stats = llm.get_kv_cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    return outputs, stats


def test_beam_search_equals_hf_in_one_mixed_batch(tiny_llama):
    path, model = tiny_llama
    jobs = all_jobs(model.config.vocab_size)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    extra = [(p, greedy) for p in prompts(model.config.vocab_size)]
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=2048)
    with LLM(str(path), dtype="float32", max_num_tokens=64, kv_cache_config=kv) as llm:
        outputs, _ = run_jobs(llm, jobs, extra)
    assert_equals_hf(model, jobs, outputs[:len(jobs)])
    for (prompt, _), output in zip(extra, outputs[len(jobs):]):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, pad_token_id=0)
        assert output.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    finished_early = [o for out in outputs[:len(jobs)] for o in out.outputs
                      if o.finish_reason == "stop"]
    assert finished_early and any(o.stop_reason in STOPS for o in finished_early)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_beam_search_on_the_gpu_equals_hf(tiny_llama):
    """Triton attention, CUDA graphs, candidates copied to pinned memory, overlap."""
    path, model = tiny_llama
    jobs = all_jobs(model.config.vocab_size)[:6]
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096)
    with LLM(str(path), dtype="float32", device="cuda", max_num_tokens=64,
             kv_cache_config=kv) as llm:
        outputs, _ = run_jobs(llm, jobs)
    assert_equals_hf(model, jobs, outputs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_groups_preempted_as_a_whole_keep_their_answers(tiny_llama, mode):
    path, model = tiny_llama
    jobs = all_jobs(model.config.vocab_size)[::2]
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION,
                             preemption_mode=mode)
    tiers = dict(host_cache_size=1 << 20) if mode == "swap" else {}
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=4 * 36, **tiers)
    with LLM(str(path), dtype="float32", max_num_tokens=64, kv_cache_config=kv,
             scheduler_config=policy) as llm:
        outputs, stats = run_jobs(llm, jobs)
    assert stats["preemptions"] > 0
    assert_equals_hf(model, jobs, outputs)


def test_groups_wait_until_all_their_beams_fit(tiny_llama):
    """Under GUARANTEED_NO_EVICT a pool too small for every group's reservation at once
    admits whole groups in turn (beams sharing their prompt's blocks reserve less, so a
    second group may join a running one)."""
    path, model = tiny_llama
    jobs = [(p, (4, 2, 1.0, False)) for p in prompts(model.config.vocab_size)]
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=4 * 4 * 8 + 8)
    with LLM(str(path), dtype="float32", max_num_tokens=64, kv_cache_config=kv) as llm:
        outputs, stats = run_jobs(llm, jobs)
    assert stats["peak_requests"] in (4, 8)  # whole groups, never all three
    assert_equals_hf(model, jobs, outputs)


def test_abort_frees_every_beam(tiny_llama):
    import asyncio

    path, model = tiny_llama
    prompt = prompts(model.config.vocab_size)[0]
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0,
                            max_tokens=200, ignore_eos=True)

    async def run(llm):
        result = llm.generate_async({"prompt_token_ids": prompt}, params)
        await asyncio.sleep(0.05)
        result.abort()
        return await result

    with LLM(str(path), dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        output = asyncio.run(run(llm))
        for _ in range(100):  # the loop frees what the aborted beams held
            if llm.get_stats()["num_running"] == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    assert [o.finish_reason for o in output.outputs] == ["abort", "abort"]


def test_best_of_returns_the_n_best_samples(tiny_llama):
    path, model = tiny_llama
    prompt = {"prompt_token_ids": prompts(model.config.vocab_size)[1]}
    with LLM(str(path), dtype="float32") as llm:
        every = llm.generate(prompt, SamplingParams(n=5, seed=7, max_tokens=8, logprobs=0),
                             use_tqdm=False)
        best = llm.generate(prompt, SamplingParams(n=2, best_of=5, seed=7, max_tokens=8),
                            use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    ranked = sorted(every.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked]
    assert [o.index for o in best.outputs] == [0, 1]
    for ours, theirs in zip(best.outputs, ranked):
        assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-5)
        assert ours.logprobs is None


@pytest.mark.parametrize("kwargs, name", [
    (dict(use_beam_search=True, best_of=4), "temperature"),
    (dict(use_beam_search=True, best_of=2, n=3, temperature=0), "best_of"),
    (dict(beam_width=2, n=3, temperature=0), "n"),
    (dict(beam_width=2, best_of=3, temperature=0), "beam_width"),
    (dict(use_beam_search=True, best_of=2, temperature=0, top_p=0.5), "top_p"),
    (dict(use_beam_search=True, best_of=2, temperature=0, logprobs=1), "logprobs"),
    (dict(use_beam_search=True, best_of=2, temperature=0, stop="x"), "stop"),
    (dict(use_beam_search=True, best_of=2, temperature=0, early_stopping="sometimes"),
     "early_stopping"),
    (dict(length_penalty=0.5), "length_penalty"),
    (dict(early_stopping=True), "early_stopping"),
    (dict(best_of=1, n=2), "best_of"),
])
def test_bad_combinations_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} "):
        SamplingParams(**kwargs)


def test_engine_limits_are_refused_and_a_stream_yields_the_end(tiny_llama):
    import asyncio

    path, _ = tiny_llama
    prompt = {"prompt_token_ids": [5, 6, 7]}

    async def stream(llm):
        result = llm.generate_async(prompt, SamplingParams(n=2, best_of=3, max_tokens=4),
                                    streaming=True)
        return [output async for output in result]

    with LLM(str(path), dtype="float32", max_batch_size=4) as llm:
        with pytest.raises(ValueError, match="max_batch_size"):
            llm.generate(prompt, SamplingParams(use_beam_search=True, best_of=8, temperature=0))
        snapshots = asyncio.run(stream(llm))
        assert len(snapshots) == 2  # one per returned sample's final delta, at the end
        assert snapshots[-1].finished and all(o.finished for o in snapshots[-1].outputs)
        out = llm.generate(prompt, SamplingParams(beam_width=4, temperature=0, max_tokens=3),
                           use_tqdm=False)
        assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) <= 3
