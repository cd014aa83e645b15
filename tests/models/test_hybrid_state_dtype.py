"""KvCacheConfig(mamba_ssm_cache_dtype=...): a hybrid's recurrent state (Mamba-2's SSM state,
gated DeltaNet's) kept in 16 bits, the update still computed in float32 (tiny random models,
fp32 on the CPU). The state tensors take the dtype, a request's state bytes shrink, and the
greedy tokens stay those of a float32 state (a bf16 state rounds each step's state; these
tiny models' margins are far wider than that)."""
from __future__ import annotations

import importlib

import pytest
import torch

from tllm import LLM, KvCacheConfig, SamplingParams

pytest.importorskip("transformers")


def _run(path, state_dtype: str, prompts):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="float32", max_num_tokens=16, max_batch_size=2,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512,
                                           mamba_ssm_cache_dtype=state_dtype)) as llm:
        cache = llm._engine.executor.runner.model.state_cache
        dtypes = {layer.ssm.dtype for layer in cache.layers}
        conv = {layer.conv.dtype for layer in cache.layers}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], dtypes, conv


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_bf16_state_keeps_the_tokens(tmp_path, family):
    module = importlib.import_module(f"tests.models.test_{family}_parity")
    model = module.save_tiny(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (21, 9)]   # 21: two prefill chunks, so the state crosses steps
    full, full_dtypes, _ = _run(tmp_path, "auto", prompts)
    half, half_dtypes, conv = _run(tmp_path, "bfloat16", prompts)
    assert full_dtypes == {torch.float32} and half_dtypes == {torch.bfloat16}
    assert conv == {torch.float32}   # the conv state stays in the activations' dtype
    assert half == full


def test_state_dtype_is_validated():
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        KvCacheConfig(mamba_ssm_cache_dtype="int8")


def test_spec_bytes_follow_the_state_dtype():
    from tllm.layers.mamba2 import StateSpec
    from tllm.models.nemotron_h import mamba_dims
    from tests.models.test_nemotron_h_parity import TINY
    import transformers
    spec = StateSpec(mamba_dims(transformers.NemotronHConfig(**TINY)), 2)
    half = spec.with_state_dtype(torch.bfloat16)
    ssm = spec.empty_layer(1, torch.float32, "meta").ssm
    assert spec.bytes_per_request(torch.float32) - half.bytes_per_request(torch.float32) == \
        2 * ssm.numel() * 2
