"""Chunked local attention (Llama 4's `attention_chunk_size`): the torch backend's batched
path against the per-sequence reference, the reference's mask against a direct statement of
the rule, and the Triton backend in an engine against HF (its kernels are tested against the
reference in tests/kernels/test_{decode,context}_attention.py)."""
import random

import pytest
import torch

from tests.attention.test_torch_batched import make_step, random_step
from tllm.attention.testing import relative_error
from tllm.attention.torch_ref import paged_attention_batched, paged_attention_ref
from tllm.kernels.paged import causal_mask


@pytest.mark.parametrize("chunk", [1, 5, 16, 300])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("window", [None, "chunk"])
def test_batched_matches_reference(chunk, block, window):
    # chunks shorter than a block, not a multiple of it, and longer than every context; the
    # cache may keep only a window of the chunk size (what the KV cache groups drop)
    window = chunk if window == "chunk" else None
    rng = random.Random(f"{chunk}-{block}-{window}")
    for kind in ("decode", "chunk", "reused", "mixed"):
        steps = random_step(rng, kind, rng.randint(2, 7), block)
        batch, cache, scales = make_step(*steps, num_kv_heads=2, group=2, head_dim=16,
                                         block=block, dtype=torch.float32)
        scale = 16 ** -0.5
        out = paged_attention_batched(batch.q, cache, batch.metadata, scale, window, scales,
                                      chunk_size=chunk)
        ref = paged_attention_ref(batch.q, cache, batch.metadata, scale, window, scales,
                                  chunk_size=chunk)
        assert not out.isnan().any()
        assert relative_error(out, ref) < 1e-5, (kind, steps)


def test_reference_mask_is_the_chunk_rule():
    mask = causal_mask(5, 12, None, torch.device("cpu"), chunk_size=4)  # positions 7..11
    for row, q_pos in enumerate(range(7, 12)):
        expected = [q_pos // 4 == k_pos // 4 and k_pos <= q_pos for k_pos in range(12)]
        assert mask[row].tolist() == expected


def test_triton_backend_gives_hf_tokens_for_llama4(device, tmp_path):
    """The Triton kernels' chunk masks in the engine: a tiny Llama 4 (chunk 6, shorter than
    most prompts and not a multiple of the 4-token KV blocks; chunked prefill over 16-token
    steps; decode steps across chunk boundaries) gives HF's greedy tokens."""
    import transformers

    from tests.models.hf_reference import hf_greedy, make_prompts
    from tests.models.test_llama4_parity import tiny_llama4_config
    from tllm import LLM, KvCacheConfig, SamplingParams
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(tiny_llama4_config()).eval()
    model.save_pretrained(tmp_path)
    prompts = [make_prompts(model.config.vocab_size)[i] for i in (1, 2, 5)]  # 17, 40, 25
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), attn_backend="triton", device=str(device), dtype="float32",
             max_num_tokens=16, max_batch_size=3, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref, _ = hf_greedy(model, prompt, 8)
        assert list(output.outputs[0].token_ids)[:len(ref)] == ref
