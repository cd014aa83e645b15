"""torch_compile_config on the CPU: decode steps through the torch.compile'd forward give the
eager path's greedy tokens, and a compile that fails leaves decode eager with one log line
(needs a C++ compiler for Inductor; skipped without one)."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from tllm import LLM, KvCacheConfig, SamplingParams, TorchCompileConfig

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="Inductor's CPU backend needs a C++ compiler")


def greedy_tokens(path, prompts, config: TorchCompileConfig | None) -> tuple[list, object]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_batch_size=4,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
             torch_compile_config=config) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        decode = llm._engine.executor.runner.cuda_graphs
    return [o.outputs[0].token_ids for o in outputs], decode


def random_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (5, 11, 3)]


@needs_compiler
def test_compiled_decode_gives_the_eager_tokens(tiny_llama):
    path, model = tiny_llama
    prompts = random_prompts(model.config.vocab_size)
    eager, _ = greedy_tokens(path, prompts, None)
    # batch 3 and, as requests finish, fewer: the batch-1 and dynamic-batch traces; the
    # contexts cross several 4-token blocks (the padded block tables)
    compiled, decode = greedy_tokens(path, prompts, TorchCompileConfig())
    assert decode is not None and decode.is_active, "compiling failed: decode ran eagerly"
    assert compiled == eager


def test_a_failed_compile_runs_eagerly_with_one_log_line(tiny_llama, monkeypatch, caplog):
    path, model = tiny_llama

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    from tllm.runner import cpu_compiled
    monkeypatch.setattr(cpu_compiled.CompiledCpuDecode, "_compiled", fail)
    prompts = random_prompts(model.config.vocab_size)[:1]
    with caplog.at_level(logging.WARNING, logger="tllm.runner.cpu_compiled"):
        tokens, decode = greedy_tokens(path, prompts, TorchCompileConfig())
    assert decode is None
    lines = [r for r in caplog.records if "torch_compile_config" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler" in lines[0].getMessage()
    assert len(tokens[0]) == 12


def test_torch_compile_is_off_by_default():
    from tllm.config import LlmArgs
    assert LlmArgs(model="x").torch_compile_config is None
