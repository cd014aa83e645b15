"""Llama 4 (text) against HF transformers (fp32, CPU): greedy tokens equal and top-5 logprobs
within 1e-3 over one continuous batch (chunked prefill, queued requests, requests finishing
at different steps, small KV blocks), with prefix reuse, and under preemption with recompute.
The tiny model has chunked RoPE layers with a chunk shorter than most prompts (and not a
multiple of the KV block), a NoPE layer whose temperature scale grows within the prompts,
the QK L2 norm, and dense and MoE layers (top-2 of 4 experts with a shared expert)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from tests.kv_cache.test_reuse_and_preemption import kv, run, shared_prefix_prompts
from tests.models.hf_reference import TOP, assert_greedy_matches_hf, hf_greedy, make_prompts
from tllm import (LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams,
                  SchedulerConfig)

CHUNK = 6
LLAMA4 = dict(head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
              num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
              interleave_moe_layer_step=2,       # MoE layers 1 and 3, dense 0 and 2
              no_rope_layers=[1, 0, 1, 1],       # layer 1 NoPE (global), the rest chunked
              attention_chunk_size=CHUNK, use_qk_norm=True, attn_temperature_tuning=True,
              floor_scale=4, attn_scale=0.5)


def tiny_llama4_config(**overrides):
    import transformers
    kwargs = {**TINY, "intermediate_size": 32, **LLAMA4, **overrides}
    return transformers.Llama4TextConfig(**kwargs, architectures=["Llama4ForCausalLM"])


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory):
    import transformers
    path = tmp_path_factory.mktemp("tiny_llama4")
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(tiny_llama4_config()).eval()
    model.save_pretrained(path)
    return path, model


def test_tiny_model_has_every_kind_of_layer(tiny_llama4):
    config = tiny_llama4[1].config
    assert config.moe_layers == [1, 3]
    assert config.layer_types == ["chunked_attention", "full_attention",
                                  "chunked_attention", "chunked_attention"]


def test_greedy_matches_hf_in_continuous_batch(tiny_llama4):
    path, hf_model = tiny_llama4
    prompts = make_prompts(hf_model.config.vocab_size)
    assert sum(len(p) > CHUNK for p in prompts) >= 8
    max_new = [16 - i % 5 for i in range(len(prompts))]  # finishing at different steps
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=TOP) for n in max_new]
    with LLM(str(path), max_num_tokens=24, max_batch_size=3,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
        assert stats["blocks_reused"] > 0  # prompts 8 and 9 share prompt 2's blocks
    assert_greedy_matches_hf(hf_model, prompts, outputs, max_new)


def test_prefix_reuse_gives_hf_tokens(tiny_llama4):
    path, hf_model = tiny_llama4
    prompts = shared_prefix_prompts(hf_model.config.vocab_size)
    tokens, stats = run(path, prompts, kv_cache_config=kv(max_tokens=1024))
    assert stats["blocks_reused"] > 0
    assert tokens == [hf_greedy(hf_model, p, 10)[0] for p in prompts]


def test_preemption_with_recompute_gives_hf_tokens(tiny_llama4):
    path, hf_model = tiny_llama4
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=g).tolist()
               for n in (20, 9, 31, 14, 25, 6)]
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION,
                             preemption_mode="recompute")
    tokens, stats = run(path, prompts, sequential=False, scheduler_config=policy,
                        kv_cache_config=kv(max_tokens=56, enable_block_reuse=False))
    assert stats["preemptions"] > 0
    assert tokens == [hf_greedy(hf_model, p, 10)[0] for p in prompts]


@pytest.mark.parametrize("change", [dict(attention_chunk_size=256),
                                    dict(attn_temperature_tuning=False),
                                    dict(use_qk_norm=False),
                                    dict(no_rope_layers=[1, 1, 1, 1])])
def test_reference_depends_on_what_is_tested(change, tiny_llama4):
    """The chunks, the temperature, the L2 norm and the NoPE layer each move HF's logits:
    the parity tests would catch any of them missing."""
    import transformers
    base = tiny_llama4[1]
    other = transformers.Llama4ForCausalLM(tiny_llama4_config(**change)).eval()
    other.load_state_dict(base.state_dict())
    ids = torch.tensor([make_prompts(base.config.vocab_size)[7]])
    with torch.no_grad():
        diff = (base(ids).logits - other(ids).logits).abs().max()
    assert diff > 1e-2


def test_chunked_layers_and_their_kv_window():
    from tllm.attention.torch_ref import TorchAttentionBackend
    from tllm.models.registry import get_model_class
    config = tiny_llama4_config()
    model = get_model_class("Llama4ForCausalLM")(config, TorchAttentionBackend, 64)
    chunks = [model.layers[i].self_attn.attn.attention_chunk_size for i in range(4)]
    assert chunks == [CHUNK, None, CHUNK, CHUNK]
    assert model.kv_cache_spec.layer_windows == (CHUNK, None, CHUNK, CHUNK)
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "LlamaMLP", "Llama4MoE", "LlamaMLP", "Llama4MoE"]


def test_dummy_preset_has_scout_width():
    """Built on the meta device: Scout's layer shapes, half its layers (~55B parameters)."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.loader.dummy import dummy_config
    model = loader.build_model(dummy_config("llama-4-scout-24l"),
                               get_attention_backend("torch"), torch.bfloat16,
                               torch.device("meta"), 4096)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(54.92, abs=0.01)
    assert tuple(model.layers[0].mlp.experts.w13_weight.shape) == (16, 2 * 8192, 5120)
    chunks = [layer.self_attn.attn.attention_chunk_size for layer in model.layers]
    assert chunks[:4] == [8192, 8192, 8192, None] and chunks.count(None) == 6


def test_auto_picks_triton_on_a_gpu():
    """The Triton kernels mask chunks (tests/attention/test_chunked_attention.py), so a
    chunked model takes them on a GPU as any other does."""
    from tllm.attention import has_attention_backend
    from tllm.runner.build import pick_backend
    assert pick_backend("auto", torch.device("cpu"), tiny_llama4_config()) == "torch"
    if has_attention_backend("triton"):
        assert pick_backend("auto", torch.device("cuda"), tiny_llama4_config()) == "triton"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_greedy_matches_hf(tiny_llama4):
    """The CUDA path (the fused MoE kernel, the Triton attention kernels with their chunk
    masks, CUDA graphs) against HF on the CPU, fp32."""
    path, hf_model = tiny_llama4
    prompts = make_prompts(hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(path), device="cuda", dtype="float32", max_num_tokens=24, max_batch_size=4,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref, _ = hf_greedy(hf_model, prompt, 12)
        assert list(output.outputs[0].token_ids)[:len(ref)] == ref


def test_released_checkpoint_class_serves_its_text_model(tmp_path):
    """Llama 4 Scout / Maverick ship as Llama4ForConditionalGeneration: the text model loads
    from it (vision tensors skipped) and gives HF's greedy tokens for text prompts."""
    import transformers
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32, pixel_shuffle_ratio=0.5)
    config = transformers.Llama4Config(text_config=tiny_llama4_config().to_dict(),
                                       vision_config=vision.to_dict(),
                                       architectures=["Llama4ForConditionalGeneration"])
    torch.manual_seed(1)
    hf_model = transformers.Llama4ForConditionalGeneration(config).eval()
    hf_model.save_pretrained(tmp_path)
    prompts = make_prompts(config.text_config.vocab_size)[:4]
    with LLM(str(tmp_path), max_num_tokens=24, max_batch_size=3,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        assert not llm.takes_images
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert output.outputs[0].token_ids[:len(want)] == want.tolist()
