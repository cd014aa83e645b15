"""Qwen3-VL (tiny, random, fp32; DeepStack on the first two of three decoder layers):
greedy tokens and top-5 logprobs equal HF transformers' for prompts with 0, 1 and 2 images
of different sizes in a continuous batch with text-only requests, with 8-token prefill
chunks cutting through the images (so a chunk adds only its part of an image's DeepStack
rows); prefix reuse with the same image; M-RoPE positions equal HF's get_rope_index."""
from __future__ import annotations

import pytest
import torch

from tests.multimodal.conftest import IMAGE, QwenReference, make_image, tiny_tokenizer
from tllm import LLM, KvCacheConfig, SamplingParams

NUM_NEW = 6
TOP = 5


def token_ids(tokenizer) -> dict:
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>")]}


def text_args(tokenizer) -> dict:
    """head_dim 16: 8 frequencies, interleaved t h w t h w t t by mrope_section [4, 2, 2]."""
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=512, pad_token_id=0,
                eos_token_id=None, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True})


# DeepStack features from vision layers 0 and 1, added after decoder layers 0 and 1 of 3
VISION_ARGS = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                   out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                   temporal_patch_size=2, num_position_embeddings=16,
                   deepstack_visual_indexes=[0, 1])


def tiny_config(tokenizer):
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(text_config=text_args(tokenizer), vision_config=VISION_ARGS,
                         **token_ids(tokenizer),
                         architectures=["Qwen3VLForConditionalGeneration"])


def tiny_image_processor():
    """Qwen3-VL's: 16-pixel patches merged 2 x 2; 1 to 16 tokens an image here."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    return Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=128 * 128)


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    """(folder, HF model, QwenReference) of a tiny random Qwen3-VL."""
    from transformers import Qwen3VLForConditionalGeneration
    path = tmp_path_factory.mktemp("tiny_qwen3_vl")
    tokenizer = tiny_tokenizer()
    images = tiny_image_processor()
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_config(tokenizer)).eval()
    model.save_pretrained(path)
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, QwenReference(images, tokenizer, model.config)


def chat_text(*parts: str) -> str:
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def hf_greedy(model, reference, text: str, images: list):
    """HF's greedy tokens and each step's log-softmax."""
    inputs = reference(text, images)
    model.model.rope_deltas = None  # HF keeps the last prompt's M-RoPE shift between calls
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [step[0].float().log_softmax(-1) for step in out.logits]


def check_logprobs(ours, hf_logprobs) -> None:
    for step, (entry, ref) in enumerate(zip(ours, hf_logprobs)):
        top_vals, top_ids = ref.topk(TOP)
        for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert tid in entry, f"step {step}: HF top-{TOP} token {tid} missing"
            assert abs(entry[tid].logprob - val) < 1e-3, f"step {step} token {tid}"


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True, logprobs=TOP)


def make_llm(path) -> LLM:
    """Chunks of 8 tokens (images of 4 to 9 tokens get cut), 4-token blocks."""
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=1024)
    return LLM(str(path), max_num_tokens=8, max_batch_size=4, kv_cache_config=kv)


def test_greedy_and_logprobs_match_hf_in_continuous_batch(tiny_qwen3_vl):
    path, hf_model, reference = tiny_qwen3_vl
    small, wide, tall = make_image(64, 64, 1), make_image(64, 96, 2), make_image(96, 64, 3)
    cases = [(chat_text("what is in this image?"), []),
             (chat_text(IMAGE, "describe the picture"), [small]),
             (chat_text("compare ", IMAGE, " and ", IMAGE), [wide, tall]),
             (chat_text("the quick brown fox"), []),
             (chat_text("a red square ", IMAGE), [make_image(96, 96, 4)])]
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
              for text, images in cases]
    with make_llm(path) as llm:
        outputs = llm.generate(inputs, params(), use_tqdm=False)
        assert llm._engine.kv_cache.num_free_blocks == llm._engine.kv_cache.num_blocks
        stats = llm.get_stats()   # the images cut by 8-token chunks: found again for the rest
        assert stats["encoder_num_encoded"] == 4 and stats["encoder_cache_hits"] > 0
    for (text, images), output in zip(cases, outputs):
        tokens, logprobs = hf_greedy(hf_model, reference, text, images)
        assert output.outputs[0].token_ids == tokens
        check_logprobs(output.outputs[0].logprobs, logprobs)


def test_deepstack_changes_hf_logits(tiny_qwen3_vl, monkeypatch):
    """The logprob check above is sensitive to DeepStack: without it HF's first-step
    logprobs move by far more than its 1e-3 tolerance."""
    _, hf_model, reference = tiny_qwen3_vl
    text, images = chat_text(IMAGE, "describe the picture"), [make_image(64, 96, 5)]
    _, with_deepstack = hf_greedy(hf_model, reference, text, images)
    language_model = hf_model.model.language_model
    monkeypatch.setattr(language_model, "_deepstack_process",
                        lambda hidden, mask, embeds: hidden)
    _, without = hf_greedy(hf_model, reference, text, images)
    assert (with_deepstack[0] - without[0]).abs().max() > 1e-2


def test_same_image_reuses_blocks(tiny_qwen3_vl):
    path, hf_model, reference = tiny_qwen3_vl
    text = IMAGE + "describe the picture in a few words"   # blocks 0-1 hold the image
    first, other = make_image(64, 96, 7), make_image(64, 96, 8)
    with make_llm(path) as llm:
        def run(image):
            before = llm.get_kv_cache_stats()["blocks_reused"]
            out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}},
                               params(), use_tqdm=False)
            return out.outputs[0].token_ids, llm.get_kv_cache_stats()["blocks_reused"] - before

        tokens, reused = run(first)
        assert reused == 0 and tokens == hf_greedy(hf_model, reference, text, [first])[0]
        again, reused = run(first.copy())          # the same pixels, another object
        assert again == tokens and reused > 0
        different, reused = run(other)
        assert reused == 0   # every block holds or follows the image
        assert different == hf_greedy(hf_model, reference, text, [other])[0]
        assert llm.get_stats()["encoder_num_encoded"] == 2


def test_mrope_positions_equal_hf_get_rope_index(tiny_qwen3_vl):
    from tllm.multimodal.processing import MultimodalProcessor
    from tllm.tokenizer import Tokenizer
    path, hf_model, reference = tiny_qwen3_vl
    ours = MultimodalProcessor(reference.image_processor, Tokenizer(reference.tokenizer),
                               hf_model.config, max_images=4)
    text = chat_text("compare ", IMAGE, " and ", IMAGE, " please")
    images = [make_image(64, 96, 2), make_image(128, 64, 3)]
    token_ids, mm = ours.process(text, images)
    inputs = reference(text, images)
    positions, delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert token_ids == inputs["input_ids"][0].tolist()
    assert (mm.mrope_positions == positions[:, 0].numpy()).all()
    assert mm.mrope_delta == int(delta[0, 0])
    assert [item.length for item in mm.items] == [6, 8]


def test_interleaved_mrope_tables_equal_hf():
    """Qwen3-VL's real section [24, 20, 20] (head_dim 128) at random [3, T] positions."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
    from tllm.layers.rotary import position_inverse_frequencies
    from tllm.models.qwen3_vl import InterleavedMRotaryEmbedding
    config = Qwen3VLTextConfig(head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
        "mrope_interleaved": True})
    inv_freq, scaling = position_inverse_frequencies(config, 128, 256)
    ours = InterleavedMRotaryEmbedding(inv_freq, scaling, 256, [24, 20, 20])
    positions = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(0))
    cos, signed_sin = ours._tables(positions, torch.float32)
    hf_cos, hf_sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions[:, None])
    torch.testing.assert_close(cos[:, 0], hf_cos[0])
    torch.testing.assert_close(signed_sin[:, 0, 64:], hf_sin[0, :, 64:])
    torch.testing.assert_close(signed_sin[:, 0, :64], -hf_sin[0, :, :64])
