"""The transformers fallback (`model_impl`): architectures we do not implement run on HF's
modeling code with our paged KV cache and attention, token-identical to HF in a continuous
batch with chunked prefill and prefix reuse; a Llama runs the same through it as natively;
models it cannot serve are refused at load with the reason."""
from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from tests.conftest import TINY
from tests.models.hf_reference import TOP, assert_greedy_matches_hf, hf_greedy, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams, loader
from tllm.distributed.mapping import Mapping
from tllm.models.transformers_impl import TransformersCausalLM

NUM_NEW = 16
# what makes each architecture differ from Llama, switched on so that the parity shows it
ARCH_EXTRAS = {
    # a window shorter than most prompts: HF masks it, our backends must too
    "Starcoder2": dict(sliding_window=8),
    # scaled embeddings, residuals, attention and logits (divided)
    "Granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=3.0),
    # parallel attention and MLP, interleaved rotary, logits multiplied
    "Cohere": dict(logit_scale=0.5),
    # a sliding-window layer (rotary) and a full one (no positions at all): two KV groups
    "Cohere2": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # a mixture of experts saved per expert: transformers' converter stacks them at load
    # (12, so that experts.10 sorts after experts.2)
    "Olmoe": dict(num_experts=12, num_experts_per_tok=2),
}
LLM_KWARGS = dict(max_num_tokens=24, max_batch_size=3,
                  kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048))


def make_model(arch: str, path, **extra):
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        **TINY, **ARCH_EXTRAS.get(arch, {}), **extra, architectures=[f"{arch}ForCausalLM"])
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    model.save_pretrained(path)
    return model


def generate(path, prompts, **kwargs):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, logprobs=TOP)
    with LLM(str(path), **LLM_KWARGS, **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        kv_cache = llm._engine.kv_cache
        assert kv_cache.num_free_blocks == kv_cache.num_blocks
        model = llm._engine.executor.runner.model
        freed = llm.get_kv_cache_stats()["blocks_freed_by_window"]
    return [o.outputs[0] for o in outputs], model, freed


@pytest.mark.parametrize("arch", list(ARCH_EXTRAS))
def test_fallback_matches_hf_in_continuous_batch(arch, tmp_path):
    hf_model = make_model(arch, tmp_path)
    prompts = make_prompts(hf_model.config.vocab_size)
    completions, model, freed = generate(tmp_path, prompts)  # model_impl="auto"
    assert isinstance(model, TransformersCausalLM)
    # window layers gave back the blocks behind their window (prompts up to 60 tokens)
    assert (freed > 0) == ("sliding_window" in ARCH_EXTRAS[arch])
    assert_greedy_matches_hf(hf_model, prompts, completions, NUM_NEW)


def test_transformers_impl_on_llama_equals_native(tiny_llama):
    path, hf_model = tiny_llama
    prompts = make_prompts(hf_model.config.vocab_size)[:8]
    native, native_model, _ = generate(path, prompts, model_impl="tllm")
    fallback, fallback_model, _ = generate(path, prompts, model_impl="transformers")
    assert not isinstance(native_model, TransformersCausalLM)
    assert isinstance(fallback_model, TransformersCausalLM)
    for ours, theirs in zip(fallback, native):
        assert ours.token_ids == theirs.token_ids
        for step, (entry, ref) in enumerate(zip(ours.logprobs, theirs.logprobs)):
            assert entry.keys() == ref.keys(), step
            assert all(abs(entry[t].logprob - ref[t].logprob) < 1e-4 for t in entry)


def test_fallback_ties_embeddings_and_takes_dummy_weights(tmp_path):
    hf_model = make_model("Starcoder2", tmp_path)  # tied by default
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = loader.build_model(config, _torch_backend(), torch.float32, torch.device("cpu"),
                               256, model_impl="auto")
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert "lm_head.weight" not in model.expected_weights()
    loader.load_weights(model, loader.ModelSource("dummy", None, "tiny"), None, seed=0)
    ours = dict(model.hf.named_parameters())
    for name, param in hf_model.named_parameters():
        if param.dim() > 1:  # every matrix rewritten (norms are 1 either way)
            assert not torch.equal(ours[name], param), name
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight


def test_incomplete_checkpoint_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    make_model("Granite", tmp_path)
    weights_file = next(tmp_path.glob("*.safetensors"))
    weights = load_file(weights_file)
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weights.*layers.1.mlp.down_proj"):
        LLM(str(tmp_path), **LLM_KWARGS)


def _torch_backend():
    from tllm.attention import get_attention_backend
    return get_attention_backend("torch")


def _build(config, **kwargs):
    return loader.build_model(config, _torch_backend(), torch.float32, torch.device("cpu"),
                              256, **kwargs)


def test_encoder_decoder_is_refused(tmp_path):
    transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                          architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder"):
        LLM(str(tmp_path), **LLM_KWARGS)


def test_state_space_model_is_refused():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match="MambaForCausalLM's modeling code does not take a "
                                         "custom attention function"):
        _build(config)


def test_linear_attention_layers_are_refused():
    config = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention layers, whose state our paged KV"):
        _build(config, model_impl="transformers")


def test_attention_sinks_are_refused():
    """Our own GPT-OSS has sinks; transformers' code on our backends would drop them."""
    config = transformers.GptOssConfig(**TINY, architectures=["GptOssForCausalLM"])
    with pytest.raises(ValueError, match="GptOssAttention passes s_aux to attention"):
        _build(config, model_impl="transformers")


def test_tllm_impl_of_unknown_architecture_is_refused():
    config = transformers.Starcoder2Config(**TINY, architectures=["Starcoder2ForCausalLM"])
    with pytest.raises(ValueError, match="unsupported model architecture 'Starcoder2ForCausalLM'"):
        _build(config, model_impl="tllm")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        _build(config, model_impl="vllm")


def test_parallelism_is_refused(monkeypatch):
    import tllm.models.transformers_impl as impl
    config = transformers.CohereConfig(**TINY, architectures=["CohereForCausalLM"])
    monkeypatch.setattr(impl.comm, "mapping", lambda: Mapping(2, 2, 1, 0))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and pipeline_parallel_size=1 "
                                         "are not supported"):
        _build(config)


def test_server_completes_through_fallback(tmp_path):
    from tllm.serve.context import ServerConfig
    from tllm.serve.http.app import build_app
    from tllm.serve.testing import ServerThread
    hf_model = make_model("Cohere", tmp_path)
    prompt = make_prompts(hf_model.config.vocab_size)[1]
    ref_tokens, _ = hf_greedy(hf_model, prompt, 4)
    with LLM(str(tmp_path), **LLM_KWARGS) as llm, ServerThread(
            build_app(llm, ServerConfig(model="tiny-cohere"))) as server:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": "tiny-cohere", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "logprobs": 1})
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]  # no tokenizer: ids
    assert [int(t.removeprefix("token_id:")) for t in tokens] == ref_tokens
