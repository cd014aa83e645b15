"""Qwen2.5-VL (tiny, random, fp32): greedy tokens equal HF transformers' for prompts with 0,
1 and 2 images of different sizes sharing a continuous batch with text-only requests, with
chunked prefill cutting through images; prefix reuse on and off (the same image reuses
blocks, a different one never does); the encoder runs once per image; bad images are
ValueErrors naming them."""
from __future__ import annotations

import base64
import io

import pytest
import torch

from tests.multimodal.conftest import IMAGE, make_image
from tllm import LLM, KvCacheConfig, SamplingParams

NUM_NEW = 8


def chat_text(*parts: str) -> str:
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def hf_greedy(model, reference, text: str, images: list) -> list[int]:
    inputs = reference(text, images)
    model.model.rope_deltas = None  # HF keeps the last prompt's M-RoPE shift between calls
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)


def make_llm(path, **kwargs) -> LLM:
    """Chunks of 8 tokens (images of 4 to 9 tokens get cut), 4-token blocks."""
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=1024,
                       enable_block_reuse=kwargs.pop("enable_block_reuse", True))
    return LLM(str(path), max_num_tokens=8, max_batch_size=4, kv_cache_config=kv, **kwargs)


def prompts_with_images():
    small, wide, tall = make_image(28, 28, 1), make_image(56, 84, 2), make_image(84, 42, 3)
    return [
        (chat_text("what is in this image?"), []),
        (chat_text(IMAGE, "describe the picture"), [small]),
        (chat_text("compare ", IMAGE, " and ", IMAGE), [wide, tall]),
        (chat_text("the quick brown fox"), []),
        (chat_text(IMAGE, "a red square"), [tall]),
    ]


@pytest.mark.parametrize("enable_block_reuse", [True, False])
def test_greedy_matches_hf_in_continuous_batch(tiny_qwen_vl, enable_block_reuse):
    path, hf_model, reference = tiny_qwen_vl
    cases = prompts_with_images()
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
              for text, images in cases]
    with make_llm(path, enable_block_reuse=enable_block_reuse) as llm:
        outputs = llm.generate(inputs, params(), use_tqdm=False)
        assert llm._engine.kv_cache.num_free_blocks == llm._engine.kv_cache.num_blocks
        stats = llm.get_stats()   # the images cut by 8-token chunks: found again for the rest
        assert stats["encoder_num_encoded"] == 3 and stats["encoder_cache_hits"] > 0
    for (text, images), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, reference, text, images)


def test_same_image_reuses_blocks_and_encoding_a_different_one_never(tiny_qwen_vl):
    path, hf_model, reference = tiny_qwen_vl
    text = IMAGE + "describe the picture in a few words"   # block 0 holds the image
    first, other = make_image(56, 56, 7), make_image(56, 56, 8)
    with make_llm(path) as llm:
        def run(image):
            before = llm.get_kv_cache_stats()["blocks_reused"]
            out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}},
                               params(), use_tqdm=False)
            return out.outputs[0].token_ids, llm.get_kv_cache_stats()["blocks_reused"] - before

        tokens, reused = run(first)
        assert reused == 0
        again, reused = run(first.copy())          # the same pixels, another object
        assert again == tokens and reused > 0
        different, reused = run(other)
        assert reused == 0   # every block holds or follows the image
        assert different == hf_greedy(hf_model, reference, text, [other])
        # once each: the repeat found its image's blocks cached, so needed no embeddings
        assert llm.get_stats()["encoder_num_encoded"] == 2


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_with_image_url_equals_generate(tiny_qwen_vl):
    path, hf_model, reference = tiny_qwen_vl
    image = make_image(42, 56, 4)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": "what is in this image?"}]}]
    with make_llm(path) as llm:
        chat = llm.chat(messages, params(), use_tqdm=False)
        text = chat_text(IMAGE, "what is in this image?")
        direct = llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}},
                              params(), use_tqdm=False)
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chat.outputs[0].token_ids == hf_greedy(hf_model, reference, text, [image])


def test_bad_images_are_value_errors_naming_them(tiny_qwen_vl):
    path = tiny_qwen_vl[0]
    bad = [("not-a-file.png", "cannot read image file"),
           (make_image(1, 40, 0), "each side needs at least 2"),
           (12, "must be a PIL image")]
    with make_llm(path, limit_mm_per_prompt={"image": 2}) as llm:
        for image, message in bad:
            with pytest.raises(ValueError, match=r"multi_modal_data\.image\[0\]") as info:
                llm.generate({"prompt": chat_text(IMAGE),
                              "multi_modal_data": {"image": [image]}},
                             params(), use_tqdm=False)
            assert message in str(info.value)
        with pytest.raises(ValueError, match="at most 2 a prompt"):
            llm.generate({"prompt": chat_text(IMAGE * 3),
                          "multi_modal_data": {"image": [make_image(28, 28, i)
                                                         for i in range(3)]}},
                         params(), use_tqdm=False)
        with pytest.raises(ValueError, match="0 image placeholders for 1 images"):
            llm.generate({"prompt": chat_text("no placeholder"),
                          "multi_modal_data": {"image": [make_image(28, 28, 0)]}},
                         params(), use_tqdm=False)
        ok = llm.generate(chat_text("still serving"), params(), use_tqdm=False)
        assert len(ok.outputs[0].token_ids) == NUM_NEW


def test_mrope_positions_equal_hf_get_rope_index(tiny_qwen_vl):
    from tllm.multimodal.processing import MultimodalProcessor
    from tllm.tokenizer import Tokenizer
    path, hf_model, reference = tiny_qwen_vl
    ours = MultimodalProcessor(reference.image_processor, Tokenizer(reference.tokenizer),
                               hf_model.config, max_images=4)
    text = chat_text("compare ", IMAGE, " and ", IMAGE, " please")
    images = [make_image(56, 84, 2), make_image(84, 42, 3)]
    token_ids, mm = ours.process(text, images)
    inputs = reference(text, images)
    positions, delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert token_ids == inputs["input_ids"][0].tolist()
    assert (mm.mrope_positions == positions[:, 0].numpy()).all()
    assert mm.mrope_delta == int(delta[0, 0])
    assert [item.length for item in mm.items] == [6, 6]


def test_file_urls_only_under_the_allowed_folder(tiny_qwen_vl, tmp_path):
    path, hf_model, reference = tiny_qwen_vl
    allowed = tmp_path / "images"
    allowed.mkdir()
    image = make_image(28, 42, 5)
    image.save(allowed / "a.png")
    image.save(tmp_path / "outside.png")

    def chat(llm, url):
        return llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "describe"}]}], params(), use_tqdm=False)

    with make_llm(path, allowed_local_media_path=str(allowed)) as llm:
        served = chat(llm, f"file://{allowed / 'a.png'}")
        assert served.outputs[0].token_ids == hf_greedy(
            hf_model, reference, chat_text(IMAGE, "describe"), [image])
        with pytest.raises(ValueError, match=r"messages\.0\.content\.0: file:// URLs may only"):
            chat(llm, f"file://{allowed / '..' / 'outside.png'}")
    with make_llm(path) as llm:
        with pytest.raises(ValueError, match="file:// image URLs are off"):
            chat(llm, f"file://{allowed / 'a.png'}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_replay_steps_without_image_tokens(tiny_qwen_vl):
    """A VLM's steps without image tokens replay CUDA graphs (decode) or piecewise graphs
    (text prompts, and prompt chunks after an image), their M-RoPE positions (shifted past
    each request's images) copied into the graphs' buffers: the tokens of an eager engine,
    and steps replayed."""
    path, _, _ = tiny_qwen_vl
    cases = prompts_with_images()
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
              for text, images in cases]
    with make_llm(path, cuda_graph_config=None) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(inputs, params(), use_tqdm=False)]
    with make_llm(path) as llm:
        graphs = llm._engine.executor.runner.cuda_graphs
        assert graphs is not None and graphs.mrope_positions is not None
        assert llm._engine.executor.runner.piecewise.mrope_positions is not None
        replays = []
        run = graphs.run
        graphs.run = lambda *args: replays.append(1) or run(*args)
        graphed = [o.outputs[0].token_ids
                   for o in llm.generate(inputs, params(), use_tqdm=False)]
    assert replays and graphed == eager
