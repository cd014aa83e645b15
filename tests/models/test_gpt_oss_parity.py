"""GPT-OSS against HF transformers (fp32, CPU): attention sinks, alternating sliding-window and
full layers, YaRN, biased experts with the clamped SwiGLU, from a 16-bit and from an MXFP4
checkpoint. Greedy tokens equal and top-5 logprobs close over one continuous batch with
chunked prefill, queued requests, prefix reuse, small KV blocks and requests finishing at
different steps; and under preemption with recompute."""
from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_reference import TOP, assert_greedy_matches_hf, make_prompts
from tllm import (LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams,
                  SchedulerConfig)
from tllm.kernels.mxfp4 import quantize_mxfp4

# prompts up to 60 tokens against a window of 8: the sliding layers drop most of the context
TINY_GPT_OSS = dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    swiglu_limit=1.0, max_position_embeddings=256, initializer_range=0.1,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 32,
                                     "rope_theta": 150000.0},
                    eos_token_id=2, bos_token_id=1, pad_token_id=0)

def _hf_reads_swiglu_limit() -> bool:
    """transformers before 5.2x hard-codes HF's clamp at 7.0 (its config has no swiglu_alpha
    either): there, the tiny model clamps where HF does."""
    import transformers
    return hasattr(transformers.GptOssConfig(), "swiglu_alpha")


if not _hf_reads_swiglu_limit():
    TINY_GPT_OSS["swiglu_limit"] = 7.0

# a different length for each request, so they finish at different steps
NUM_NEW = [16, 5, 12, 9, 16, 3, 14, 7, 11, 16]


def make_tiny_gpt_oss(path, seed: int = 0):
    """A random HF GPT-OSS saved to `path`: the alternating layer types of its config's
    defaults, YaRN; norms, biases and sinks random (HF starts biases at 0)."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**TINY_GPT_OSS, architectures=["GptOssForCausalLM"])
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.rope_parameters["rope_type"] == "yarn"
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name or name.endswith("sinks"):
                param.copy_(param.mean() + 0.5 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def run(path, prompts, num_new, inspect=None, **llm_args):
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=TOP) for n in num_new]
    llm_args = {"max_num_tokens": 24, "max_batch_size": 3,
                "kv_cache_config": KvCacheConfig(tokens_per_block=4, max_tokens=2048),
                **llm_args}
    with LLM(str(path), **llm_args) as llm:
        if inspect is not None:
            inspect(llm._engine.executor.runner.model)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    return [o.outputs[0] for o in outputs], stats


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_tiny_gpt_oss(path)


def test_greedy_matches_hf_in_continuous_batch(tiny_gpt_oss):
    path, hf_model = tiny_gpt_oss
    prompts = make_prompts(hf_model.config.vocab_size)
    completions, stats = run(path, prompts, NUM_NEW)
    assert stats["blocks_reused"] > 0  # prompts 8 and 9 share prompt 2's prefix
    assert_greedy_matches_hf(hf_model, prompts, completions, NUM_NEW)


def test_preemption_with_recompute_keeps_hf_answers(tiny_gpt_oss):
    path, hf_model = tiny_gpt_oss
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=g).tolist()
               for n in (20, 9, 31, 14, 25, 6, 17, 28)]
    num_new = [16, 12, 16, 9, 16, 3, 14, 7]
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION,
                             preemption_mode="recompute")
    completions, stats = run(path, prompts, num_new, max_num_tokens=64, max_batch_size=8,
                             scheduler_config=policy,
                             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=64,
                                                           enable_block_reuse=False))
    assert stats["preemptions"] > 0
    assert_greedy_matches_hf(hf_model, prompts, completions, num_new)


def save_mxfp4(hf_model, path):
    """The model with its experts in MXFP4, as GPT-OSS's checkpoints store them (gate/up
    rows interleaved, `quantization_config` in config.json); returns the HF model with the
    experts transformers' own decoder makes of those blocks."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf_model.save_pretrained(path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(key).transpose(1, 2))  # [E, out, in]
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        # what transformers makes of the blocks: the reference model's weights
        hf_model.get_parameter(key).data.copy_(
            convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    for file in path.glob("*.safetensors"):
        file.unlink()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return hf_model


def test_mxfp4_checkpoint_matches_hf_on_its_dequantized_experts(tmp_path):
    hf_model = save_mxfp4(make_tiny_gpt_oss(tmp_path / "bf16", seed=1), tmp_path / "mxfp4")
    prompts = make_prompts(hf_model.config.vocab_size)[:6]

    def kept_packed(model):
        experts = model.layers[0].mlp.experts
        assert experts.quant.name == "mxfp4" and experts.w13_blocks.dtype == torch.uint8

    completions, _ = run(tmp_path / "mxfp4", prompts, NUM_NEW[:6], inspect=kept_packed)
    assert_greedy_matches_hf(hf_model, prompts, completions, NUM_NEW[:6])


def test_dummy_preset_has_the_real_shapes():
    """dummy:gpt-oss-20b on the meta device, MXFP4 as declared: 20.9 billion parameters
    (two FP4 values a byte), alternating 128-token windows."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    source = loader.resolve_model("dummy:gpt-oss-20b")
    config, _ = loader.load_config(source)
    model = loader.build_model(config, get_attention_backend("torch"), torch.bfloat16,
                               torch.device("meta"), 4096,
                               loader.quant_config(source, config, None))
    values = sum(p.numel() * (2 if name.endswith("blocks") else 1)
                 for name, p in model.named_parameters() if not name.endswith("scales"))
    assert values / 1e9 == pytest.approx(20.91, abs=0.01)
    assert tuple(model.layers[0].mlp.experts.w13_blocks.shape) == (32, 2 * 2880, 90, 16)
    assert model.kv_cache_spec.layer_windows[:4] == (128, None, 128, None)


def test_dummy_weights_fill_packed_experts():
    import transformers
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.layers.quant.mxfp4 import Mxfp4Config
    from tllm.loader.dummy import init_dummy_weights
    config = transformers.GptOssConfig(**TINY_GPT_OSS, architectures=["GptOssForCausalLM"])
    model = loader.build_model(config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 256, Mxfp4Config())
    init_dummy_weights(model)
    experts = model.layers[1].mlp.experts
    assert experts.w13_blocks.float().std() > 50  # random bytes
    assert 119 <= int(experts.w2_scales.min()) <= int(experts.w2_scales.max()) < 123
    assert model.layers[0].self_attn.sinks.std() > 0


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-sliced", "mxfp4-ep"])
def test_tensor_parallel_equals_one_rank(tmp_path, quantized):
    """TP=2 on gloo: heads and their sinks split, the experts' intermediate features sliced
    with the down bias added once (16-bit), or whole MXFP4 experts on each rank
    (`enable_expert_parallel`)."""
    hf_model = make_tiny_gpt_oss(tmp_path / "bf16")
    path = tmp_path / "bf16"
    if quantized:
        path = tmp_path / "mxfp4"
        save_mxfp4(hf_model, path)
    prompts = make_prompts(384)[:6]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        with LLM(str(path), tensor_parallel_size=tp, enable_expert_parallel=quantized,
                 max_num_tokens=24, device="cpu",   # gloo ranks, also beside a GPU
                 kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
            runs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "mxfp4"])
def test_cuda_greedy_matches_hf(tmp_path, quantized):
    """The CUDA path (Triton attention with sinks, the clamped-SwiGLU expert kernels, CUDA
    graphs for decode), fp32 activations, against HF on the CPU."""
    hf_model = make_tiny_gpt_oss(tmp_path / "fp32")
    path = tmp_path / "fp32"
    if quantized:
        path = tmp_path / "mxfp4"
        hf_model = save_mxfp4(hf_model, path)
    prompts = make_prompts(hf_model.config.vocab_size)
    completions, _ = run(path, prompts, NUM_NEW, device="cuda", dtype="float32",
                         max_seq_len=128)
    assert_greedy_matches_hf(hf_model, prompts, completions, NUM_NEW, logprobs=False)
