"""GGUF files of the round's architectures, written from tiny random HF models by a stand-in
for llama.cpp's converter (tests/loader/gguf_writer.py): greedy tokens from `LLM(<file>.gguf)`
equal HF transformers' (fp32) over 12 tokens on 4 prompts in one continuous batch (chunked
prefill, a shared prefix, small KV blocks, prompts past Gemma's and Phi-3's sliding windows),
top-5 logprobs within 1e-3; transformers' own GGUF reader, where it knows the architecture,
reads back the original weights from our files (which checks the writer's conventions against
an independent reader); Q8_0 files dequantized equal transformers reading the same file, and
kept quantized (int8 per channel; experts dequantized) stay close to it."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.loader.gguf_writer import write_gguf
from tests.models.test_dense_parity import save_tiny
from tests.models.test_gemma_parity import make_tiny_gemma
from tests.models.hf_reference import TOP, assert_greedy_matches_hf, check_logprobs, hf_greedy
from tests.models.test_moe_parity import make_tiny_moe
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.layers.quant.gguf import GgufLinearMethod
from tllm.loader import CheckpointError
from tllm.loader.gguf import GGUFCheckpoint

NUM_NEW = 12
# name -> (GGUF architecture, HF model saved to a directory). GGUF cannot carry a Gemma
# softmax scale apart from head_dim (llama.cpp derives it), nor Qwen2-MoE dense layers.
MODELS = {
    "llama": ("llama", lambda path: save_tiny("Llama", path)),
    "mixtral": ("llama", lambda path: make_tiny_moe("Mixtral", path)),
    "qwen2moe": ("qwen2moe", lambda path: make_tiny_moe("Qwen2Moe", path, mlp_only_layers=[])),
    "qwen3moe": ("qwen3moe", lambda path: make_tiny_moe("Qwen3Moe", path)),
    "gemma2": ("gemma2", lambda path: make_tiny_gemma("Gemma2", path, query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", lambda path: make_tiny_gemma("Gemma3", path, query_pre_attn_scalar=16)),
    "phi3": ("phi3", lambda path: save_tiny("Phi3", path)),  # longrope, partial, window 32
    "olmo2": ("olmo2", lambda path: save_tiny("Olmo2", path)),
    "gptneox": ("gptneox", lambda path: save_tiny("GPTNeoX", path)),
}
# transformers' GGUF reader has no Mixtral (llama with experts), OLMo 2 or GPT-NeoX
TRANSFORMERS_READS = ["llama", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3"]


def make_prompts() -> list[list[int]]:
    """Within Phi-3's original context (48) with their new tokens; two longer than its window
    (32) by the end, all but one longer than Gemma's (8); the last shares 16 tokens."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 11, 24)]
    return prompts + [prompts[2][:16] + torch.randint(3, 384, (14,), generator=g).tolist()]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (HF model, F32 GGUF path), built once per name."""
    cache = {}

    def get(name: str, qtype: str = "F32"):
        if (name, qtype) not in cache:
            arch, build = MODELS[name]
            path = tmp_path_factory.mktemp(f"{name}_{qtype}")
            hf_model = cache[name, "F32"][0] if (name, "F32") in cache else build(path / "hf")
            hf_model.generation_config.eos_token_id = None  # all NUM_NEW tokens, as ours
            cache[name, qtype] = hf_model, write_gguf(hf_model, path / f"{name}.gguf", arch,
                                                      qtype)
        return cache[name, qtype]
    return get


def generate(path, prompts, quantization=None):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, logprobs=TOP, ignore_eos=True)
    with LLM(str(path), max_num_tokens=24, max_batch_size=3, quantization=quantization,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        model = llm._engine.executor.runner.model
        forms = {m.quant.form for m in model.modules()
                 if isinstance(getattr(m, "quant", None), GgufLinearMethod)}
    return [output.outputs[0] for output in outputs], forms


@pytest.mark.parametrize("name", list(MODELS))
def test_f32_gguf_matches_hf(written, name):
    hf_model, path = written(name)
    prompts = make_prompts()
    completions, _ = generate(path, prompts)
    assert_greedy_matches_hf(hf_model, prompts, completions, NUM_NEW)


def transformers_from_gguf(hf_model, path):
    """transformers' own reading of the file (its config from the HF model: its GGUF config
    mapping misses keys such as the soft-caps and expert sizes)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 config=hf_model.config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", TRANSFORMERS_READS)
def test_transformers_reads_the_original_weights(written, name):
    hf_model, path = written(name)
    ours = hf_model.state_dict()
    theirs = transformers_from_gguf(hf_model, path).state_dict()
    assert theirs.keys() == ours.keys()
    for key, tensor in ours.items():
        torch.testing.assert_close(theirs[key], tensor, rtol=0, atol=1e-6, msg=key)


def first_divergence_in_top5(ours, ref_tokens, ref_logprobs) -> None:
    """Tokens equal, or where they first part each side's token is in the other's top 5."""
    for step, (token, ref) in enumerate(zip(ours.token_ids, ref_tokens)):
        if token != ref:
            assert token in ref_logprobs[step].topk(TOP).indices.tolist()
            assert ref in ours.logprobs[step]
            return


@pytest.mark.parametrize("name", ["phi3", "qwen3moe"])
def test_q8_0_gguf(written, name, caplog):
    """Phi-3's fused q/k/v and gate/up blocks cut at load; Qwen3-MoE's experts dequantized
    with a notice. Dequantized: transformers' reading of the same file, exactly; kept as
    int8 per channel: close to it."""
    hf_model, path = written(name, "Q8_0")
    reference = transformers_from_gguf(hf_model, path)
    prompts = make_prompts()
    with caplog.at_level(logging.INFO, logger="tllm.loader.gguf"):
        dense, dense_forms = generate(path, prompts, quantization="none")
    assert dense_forms == {"dense"}
    assert ("expert weights (Q8_0) are dequantized" in caplog.text) == (name == "qwen3moe")
    kept, kept_forms = generate(path, prompts)
    assert kept_forms == {"int8"}
    for prompt, exact, close in zip(prompts, dense, kept):
        ref_tokens, ref_logprobs = hf_greedy(reference, prompt, NUM_NEW)
        assert exact.token_ids == ref_tokens
        check_logprobs(exact.logprobs, ref_logprobs, ref_tokens)
        first_divergence_in_top5(close, ref_tokens, ref_logprobs)


def test_config_from_metadata(written):
    """Gemma 3's layer kinds, rope bases and scaling, and Phi-3's longrope, as HF has them."""
    hf_model, path = written("gemma3")
    config = GGUFCheckpoint(path).config()
    assert config.layer_types == hf_model.config.layer_types
    assert config.rope_parameters == hf_model.config.rope_parameters
    assert config.sliding_window == hf_model.config.sliding_window
    hf_model, path = written("phi3")
    config = GGUFCheckpoint(path).config()
    for key in ("rope_type", "long_factor", "short_factor", "partial_rotary_factor"):
        assert config.rope_parameters[key] == pytest.approx(hf_model.config.rope_parameters[key])
    assert config.sliding_window == 32 and config.original_max_position_embeddings == 48


def write_minimal(path, arch: str, extra_tensor: str | None = None):
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.ones(2, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF architecture 'bloom' is not supported"):
        LLM(str(write_minimal(tmp_path / "m.gguf", "bloom")))


def test_llama3_rope_factors_refused(tmp_path):
    checkpoint = GGUFCheckpoint(write_minimal(tmp_path / "m.gguf", "llama", "rope_freqs.weight"))
    with pytest.raises(CheckpointError, match="rope_freqs"):
        checkpoint.rope_parameters(head_dim=4)
