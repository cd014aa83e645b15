"""Gemma 2 and Gemma 3 (text) against HF transformers (fp32, eager attention: HF's path that
soft-caps): greedy tokens equal and top-5 logprobs within 1e-3, on prompts longer than the
sliding window, in one continuous batch with chunked prefill, prefix reuse and small KV
blocks. The tiny models have both kinds of layer, soft-caps small enough to bite, a softmax
scale apart from head_dim ** -0.5 and norm weights away from zero (Gemma's 1 + w)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import TINY
from tests.models.hf_reference import TOP, assert_greedy_matches_hf, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams

NUM_NEW = 16
WINDOW = 8  # every prompt but two is longer
GEMMA_COMMON = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    hidden_activation="gelu_pytorch_tanh")
CONFIGS = {
    # sliding, global, sliding, global
    "Gemma2": dict(num_hidden_layers=4, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    # five sliding layers, then a global one; global rope linearly scaled, its own base
    "Gemma3": dict(num_hidden_layers=6, final_logit_softcapping=None, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
}


def tiny_gemma_config(arch: str, **overrides):
    import transformers
    config_cls = transformers.Gemma2Config if arch == "Gemma2" else transformers.Gemma3TextConfig
    kwargs = {**TINY, **GEMMA_COMMON, **CONFIGS[arch], **overrides}
    return config_cls(**kwargs, architectures=[f"{arch}ForCausalLM"],
                      attn_implementation="eager")


def make_tiny_gemma(arch: str, path, seed: int = 0, **overrides):
    """Save a random HF Gemma model; its norm weights random too (HF initialises them 0)."""
    import transformers
    torch.manual_seed(seed)
    config = tiny_gemma_config(arch, **overrides)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["Gemma2", "Gemma3"])
def tiny_gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny_{request.param.lower()}")
    return path, make_tiny_gemma(request.param, path)


def test_greedy_matches_hf_in_continuous_batch(tiny_gemma):
    path, hf_model = tiny_gemma
    types = hf_model.config.layer_types
    assert {"sliding_attention", "full_attention"} == set(types)
    prompts = make_prompts(hf_model.config.vocab_size)
    assert sum(len(p) > WINDOW for p in prompts) >= 8
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, logprobs=TOP)
    with LLM(str(path), max_num_tokens=24, max_batch_size=4,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm._engine.kv_cache
        assert stats.num_free_blocks == stats.num_blocks
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW)


@pytest.mark.parametrize("change", [dict(attn_logit_softcapping=None),
                                    dict(final_logit_softcapping=None),
                                    dict(sliding_window=256),
                                    dict(query_pre_attn_scalar=16)])
def test_reference_depends_on_what_is_tested(change, tmp_path):
    """The tiny Gemma 2's soft-caps, window and scale each move HF's logits: the parity test
    would catch any of them missing."""
    import transformers
    base = make_tiny_gemma("Gemma2", tmp_path)
    other = transformers.Gemma2ForCausalLM(tiny_gemma_config("Gemma2", **change)).eval()
    other.load_state_dict(base.state_dict())
    ids = torch.tensor([make_prompts(base.config.vocab_size)[7]])
    with torch.no_grad():
        diff = (base(ids).logits - other(ids).logits).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("arch", ["Gemma2", "Gemma3"])
def test_attention_options_per_layer(arch):
    from tllm.attention.torch_ref import TorchAttentionBackend
    from tllm.models.registry import get_model_class
    config = tiny_gemma_config(arch)
    model = get_model_class(f"{arch}ForCausalLM")(config, TorchAttentionBackend, 64)
    cap = 2.0 if arch == "Gemma2" else None  # HF's Gemma 3 never soft-caps attention
    for i, kind in enumerate(config.layer_types):
        options = model.attention_options(i)
        window = WINDOW if kind == "sliding_attention" else None
        assert options == dataclasses.replace(options, sliding_window=window, scale=24 ** -0.5,
                                              logits_soft_cap=cap)
        backend = model.layers[i].self_attn.attn
        assert (backend.sliding_window, backend.scale, backend.logits_soft_cap) == (
            window, 24 ** -0.5, cap)


@pytest.mark.parametrize("change, match", [
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
])
def test_unservable_configs_are_refused(change, match):
    from tllm.attention.torch_ref import TorchAttentionBackend
    from tllm.models.gemma2 import Gemma2ForCausalLM
    with pytest.raises(ValueError, match=match):
        Gemma2ForCausalLM(tiny_gemma_config("Gemma2", **change), TorchAttentionBackend, 64)
