"""Piecewise CUDA graphs (everything but attention captured per token bucket) give the
eager engine's greedy tokens over steps mixing prompt chunks with decodes, padded to
larger buckets; on the CPU the bucket table and the replay's attention calls are checked."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, CudaGraphConfig, KvCacheConfig, SamplingParams
from tllm.attention.interface import AttentionMetadata
from tllm.runner.piecewise import AttentionCall, token_buckets

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def prompts(vocab: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=g).tolist()}
            for n in torch.randint(1, 90, (count,), generator=g)]


def run(path, batch, piecewise: bool | None, dtype: str = "float32"):
    """Greedy tokens and how many steps replayed piecewise graphs (None: no graphs)."""
    config = None if piecewise is None else CudaGraphConfig(
        batch_sizes=[1, 2, 4, 8], piecewise=piecewise, token_buckets=[16, 48])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype=dtype, max_batch_size=8, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192),
             cuda_graph_config=config) as llm:
        runner = llm._engine.executor.runner
        replays = []
        if runner.piecewise is not None:
            real = runner.piecewise.run
            runner.piecewise.run = lambda ids, md: replays.append(ids.shape[0]) or real(ids, md)
        outs = llm.generate(batch, params, use_tqdm=False)
        kv = llm._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
    return [o.outputs[0].token_ids for o in outs], replays


@cuda
def test_piecewise_graphs_give_the_eager_tokens(tiny_llama):
    path, model = tiny_llama
    batch = prompts(model.config.vocab_size, 12)   # chunked: 64 tokens a step at most
    batch.append(dict(batch[0]))                   # a prefix that is reused
    eager, _ = run(path, batch, None)
    graphed, replays = run(path, batch, True)
    assert graphed == eager
    assert replays and all(n <= 64 for n in replays)
    assert any(n not in (16, 48, 64) for n in replays)  # padded to a larger bucket
    decode_only, replays = run(path, batch, False)
    assert decode_only == eager and not replays


def test_token_buckets_end_at_max_num_tokens():
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(64, [8, 64, 200]) == [8, 64]
    assert token_buckets(8192)[-1] == 8192 and 4096 in token_buckets(8192)


def test_an_attention_call_runs_on_the_steps_tokens_and_view():
    """The replayed call sees the step's first tokens and its metadata (or group view)
    and fills the head of the fixed output buffer, leaving the padding rows alone."""
    seen = []

    def method(q, k, v, kv_cache, metadata, scale):
        seen.append((q.shape[0], k.shape[0], metadata, scale))
        return q * scale

    q = torch.randn(8, 2, 4)
    out = torch.zeros(8, 2, 4)
    metadata = AttentionMetadata(*([torch.zeros(1)] * 5), 1, 1, 16, [1], [1])
    metadata.group_views = ["view0", "view1"]
    AttentionCall(method, (q, q, q, "cache", 2.0), 1, out).run(metadata, 5)
    assert seen == [(5, 5, "view1", 2.0)]
    torch.testing.assert_close(out[:5], q[:5] * 2)
    assert not out[5:].any()


@cuda
def test_sampling_options_on_the_gpu_give_the_eager_tokens(tiny_llama):
    """Seeded sampling with top-k/top-p, penalties (counted on the device) and logprobs:
    the same tokens with every kind of graph as without any (the noise is keyed by seed
    and position, so only the logits could differ, and in float32 they agree)."""
    path, model = tiny_llama
    batch = prompts(model.config.vocab_size, 6)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=i,
                             repetition_penalty=1.2, presence_penalty=0.3,
                             frequency_penalty=0.2, logprobs=2, ignore_eos=True)
              for i in range(len(batch))]

    def sample(config):
        with LLM(str(path), dtype="float32", max_batch_size=8, max_num_tokens=64,
                 kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192),
                 cuda_graph_config=config) as llm:
            outs = llm.generate(batch, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [sorted(lp) for lp in o.outputs[0].logprobs])
                for o in outs]

    eager = sample(None)
    graphed = sample(CudaGraphConfig(batch_sizes=[1, 2, 4, 8], token_buckets=[16, 48]))
    assert graphed == eager
    assert len({tuple(tokens) for tokens, _ in eager}) == len(batch)  # really sampled
