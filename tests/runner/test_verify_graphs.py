"""CUDA graphs for speculative verify steps (1 + k query tokens a request).

On the CPU the graph's buffer packing is checked with the Triton kernels interpreted: a
"graph" that replays the captured forward eagerly over the runner's static buffers must give
the logits of the plain eager forward for a step mixing query lengths (padded to a larger
captured batch) and write the same KV slots, nothing more. On a GPU the engine itself runs
with verify graphs: greedy tokens identical with and without speculation and graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import setup_triton_for_tests  # noqa: E402

DEVICE = setup_triton_for_tests()

from tllm import LLM, CudaGraphConfig, KvCacheConfig, SamplingParams  # noqa: E402
from tllm.config import NGramDecodingConfig  # noqa: E402
from tllm.runner.cuda_graph import CudaGraphRunner  # noqa: E402
from tllm.runner.batch_state import StepArrays  # noqa: E402
from tllm.runner.step import step_tensors  # noqa: E402
from tllm.upload import Uploader  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
BLOCK = 4


class EagerReplay:
    """Stands in for a captured graph on the CPU: replays the captured shape's forward."""

    def __init__(self, runner: CudaGraphRunner, batch_size: int, query_len: int) -> None:
        self.forward = lambda: runner._forward(batch_size, query_len)
        self.logits = torch.empty(batch_size * query_len, runner.model.config.vocab_size,
                                  device=runner.device)

    def replay(self) -> None:
        self.logits.copy_(self.forward())


def verify_step(query_lens: list[int], prefix_lens: list[int], vocab: int):
    """(input ids, metadata) of a step where request i has prefix_lens[i] cached tokens,
    then query_lens[i] new ones, in its own blocks (block 0 left unused)."""
    g = torch.Generator().manual_seed(1)
    ids, positions, slots, tables, next_block = [], [], [], [], 1
    for q, p in zip(query_lens, prefix_lens):
        num_blocks = -(-(p + q) // BLOCK)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        tables.append(table)
        ids += torch.randint(3, vocab, (q,), generator=g).tolist()
        positions += list(range(p, p + q))
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(p, p + q)]
    width = max(len(t) for t in tables)
    arrays = StepArrays(np.array(positions), np.array(slots),
                        np.array([0, *np.cumsum(query_lens)]),
                        np.array([p + q for p, q in zip(query_lens, prefix_lens)]),
                        np.array([t + [0] * (width - len(t)) for t in tables]), [], [],
                        np.repeat(np.arange(len(query_lens)), query_lens))
    tensors = step_tensors(arrays, np.array(ids), np.arange(len(ids)), (), BLOCK,
                           Uploader(DEVICE, torch.int64), Uploader(DEVICE, torch.int32))
    return tensors.input_ids, tensors.metadata


def eager_llm(path) -> LLM:
    """The tiny model without graphs: its model and KV cache back a runner built by hand."""
    return LLM(str(path), attn_backend="triton", dtype="float32", device=str(DEVICE),
               max_batch_size=4, max_seq_len=64, cuda_graph_config=None,
               kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=256))


def test_verify_graph_buffers_replay_a_mixed_step_like_eager(tiny_llama):
    path, hf = tiny_llama
    with eager_llm(path) as llm:
        model, kv = llm._engine.executor.runner.model, llm._engine.kv_cache
        runner = CudaGraphRunner(model, kv, [1, 4], 64, DEVICE, verify_query_len=5)
        runner.verify_graphs = {bs: (graph, graph.logits, None) for bs in (1, 4)
                                for graph in [EagerReplay(runner, bs, 5)]}
        for k, v in kv.kv_caches:  # the cached prefixes: random keys and values
            k.normal_()
            v.normal_()
        # 3 requests (padded to 4): 4 drafts, a plain decode, 2 drafts
        input_ids, metadata = verify_step([5, 1, 3], [20, 7, 12], hf.config.vocab_size)
        assert runner.can_run(input_ids.shape[0], 3, metadata.max_query_len)
        assert not runner.can_run(6 * 5, 5, 5)  # more requests than the largest capture
        assert not runner.can_run(6, 1, 6)      # a longer query than the capture's
        with torch.inference_mode():
            expected = model.compute_logits(model(input_ids, kv.kv_caches, metadata))
            cache_after_eager = [t.clone() for pair in kv.kv_caches for t in pair]
            got = runner.run(input_ids, metadata)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        # the padding rows and the padding request wrote no KV slot
        for before, now in zip(cache_after_eager, [t for pair in kv.kv_caches for t in pair]):
            # (the same values, to rounding: a GPU's GEMMs may round differently at another M)
            torch.testing.assert_close(before, now, rtol=1e-5, atol=1e-5)


def test_eager_warm_up_runs_each_tile_choice_and_writes_no_kv(tiny_llama, monkeypatch):
    path, hf = tiny_llama
    with eager_llm(path) as llm:
        model, kv = llm._engine.executor.runner.model, llm._engine.kv_cache
        runner = CudaGraphRunner(model, kv, [1, 4], 64, DEVICE)
        for k, v in kv.kv_caches:
            k.normal_()
            v.normal_()
        before = [t.clone() for pair in kv.kv_caches for t in pair]
        steps = []
        monkeypatch.setattr(model, "compute_logits", lambda hidden: steps.append(
            hidden.shape[0]) or hidden)
        runner.warm_up_eager(model)
        assert steps == [2, 4]  # the lengths of WARM_UP_QUERY_LENS the 4-row buffers hold
        assert all(torch.equal(a, b) for a, b in
                   zip(before, [t for pair in kv.kv_caches for t in pair]))
        assert not runner.seq_lens.any()


def prompts(vocab: int) -> list[list[int]]:
    """Repetitive prompts (the n-gram drafter finds continuations) and a random one."""
    g = torch.Generator().manual_seed(3)
    span = torch.randint(3, vocab, (6,), generator=g).tolist()
    return [span * 4, torch.randint(3, vocab, (25,), generator=g).tolist(), span * 2 + [7]]


def generate(path, spec: bool, graphs: bool, count: int, max_tokens: int, device):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kwargs = dict(attn_backend="triton", dtype="float32", device=str(device),
                  max_batch_size=4, max_num_tokens=64, max_seq_len=128,
                  kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=1024),
                  cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4]) if graphs else None)
    if spec:
        kwargs["speculative_config"] = NGramDecodingConfig(max_draft_len=4,
                                                           max_matching_ngram_size=2)
    with LLM(str(path), **kwargs) as llm:
        vocab = llm._engine.config.vocab_size
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)[:count]],
                            params, use_tqdm=False)
        kv = llm._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        stats = llm.get_stats()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def test_triton_verify_steps_on_the_decode_kernel_keep_greedy_tokens(tiny_llama):
    """Verify steps attend with the decode kernel (several queries a sequence): greedy
    output as without speculation (interpreted on the CPU)."""
    path, _ = tiny_llama
    plain, _ = generate(path, spec=False, graphs=False, count=1, max_tokens=10, device=DEVICE)
    spec, stats = generate(path, spec=True, graphs=False, count=1, max_tokens=10,
                           device=DEVICE)
    assert spec == plain
    assert stats["spec_accepted_tokens"] > 0


@cuda
def test_engine_replays_verify_graphs_with_identical_greedy_tokens(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    replays = {"decode": 0, "verify": 0}
    run = CudaGraphRunner.run

    def counting_run(self, input_ids, metadata):
        replays["decode" if metadata.max_query_len == 1 else "verify"] += 1
        return run(self, input_ids, metadata)
    monkeypatch.setattr(CudaGraphRunner, "run", counting_run)
    eager, _ = generate(path, spec=False, graphs=False, count=3, max_tokens=40, device="cuda")
    plain, _ = generate(path, spec=False, graphs=True, count=3, max_tokens=40, device="cuda")
    assert replays["decode"] > 0 and replays["verify"] == 0
    spec, stats = generate(path, spec=True, graphs=True, count=3, max_tokens=40,
                           device="cuda")
    assert eager == plain == spec
    assert replays["verify"] > 0
    assert stats["spec_accepted_tokens"] > 0
