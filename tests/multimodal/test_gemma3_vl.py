"""Gemma 3 with images (tiny, random, fp32; SigLIP tower, Gemma 3 decoder with sliding and
global layers): greedy tokens equal HF transformers' Gemma3ForConditionalGeneration (whose
image tokens attend to each other both ways in prefill) for prompts with 0, 1 and 2 images
in one continuous batch, with prefix reuse on and off, and with pan-and-scan crops; the same
image reuses cached blocks, a different image does not."""
from __future__ import annotations

import pytest
import torch

from tests.multimodal.conftest import CORPUS, image_data_url, make_image, reuse_runs
from tllm import LLM, KvCacheConfig, SamplingParams

NUM_NEW = 8
BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
SPECIAL = ["<pad>", "<bos>", "<eos>", BOI, EOI, SOFT]
TOKENS_PER_IMAGE = 4   # 4 x 4 patches pooled 2 x 2
CHAT_TEMPLATE = (  # Gemma's turns, with an image part written as <start_of_image>
    "{% for m in messages %}<bos>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + BOI +
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<eos>\n{% endfor %}{% if add_generation_prompt %}<bos>model\n{% endif %}")


def tiny_gemma3_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS + ["\n\n", "a\n\nb"], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_gemma3_config(tokenizer):
    from transformers import Gemma3Config
    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=24, sliding_window=6,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
                eos_token_id=None, final_logit_softcapping=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7)
    return Gemma3Config(text_config=text, vision_config=vision,
                        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=ids(SOFT),
                        boi_token_index=ids(BOI), eoi_token_index=ids(EOI),
                        architectures=["Gemma3ForConditionalGeneration"],
                        attn_implementation="eager")


@pytest.fixture(scope="module")
def tiny_gemma3_vl(tmp_path_factory):
    """(folder, HF model, Gemma3Processor) of a tiny random Gemma 3 with images."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil)
    path = tmp_path_factory.mktemp("tiny_gemma3_vl")
    tokenizer = tiny_gemma3_tokenizer()
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                                image_seq_length=TOKENS_PER_IMAGE)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(tiny_gemma3_config(tokenizer)).eval()
    with torch.no_grad():  # HF initialises Gemma's (1 + w) norms and the projection at 0
        for name, param in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, processor


def hf_greedy(model, processor, text: str, images: list) -> list[int]:
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)


def make_llm(path, enable_block_reuse: bool = True, max_num_tokens: int = 128) -> LLM:
    """4-token blocks."""
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=1024,
                       enable_block_reuse=enable_block_reuse)
    return LLM(str(path), max_num_tokens=max_num_tokens, max_batch_size=4,
               kv_cache_config=kv)


def prompts_with_images():
    return [(f"describe the picture {BOI}", [make_image(28, 28, 1)]),
            ("what is in this image?", []),
            (f"compare {BOI} and {BOI} now", [make_image(56, 84, 2), make_image(40, 30, 3)]),
            ("the quick brown fox jumps over the lazy dog", [])]


def as_inputs(cases):
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
            for text, images in cases]


@pytest.mark.parametrize("enable_block_reuse,max_num_tokens", [(True, 128), (False, 128),
                                                               (True, 12)])
def test_greedy_matches_hf_in_continuous_batch(tiny_gemma3_vl, enable_block_reuse,
                                               max_num_tokens):
    """max_num_tokens=12: prefill chunks end before an image they would cut (its tokens must
    all be in one step to see each other)."""
    path, hf_model, processor = tiny_gemma3_vl
    cases = prompts_with_images()
    with make_llm(path, enable_block_reuse, max_num_tokens) as llm:
        outputs = llm.generate(as_inputs(cases), params(), use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images)


# (prompt, blocks a repeat reuses): the second prompt's 32 tokens end in its image (soft
# tokens at 25..28) and two more; its repeat reuses 7 blocks, which stop inside the image:
# the rest of it, computed in the next step, still attends to the cached part both ways
REUSE_CASES = [(f"{BOI}describe the picture in a few words", None),
               (f"a red square and a blue circle, {BOI}", 7)]


@pytest.mark.parametrize("text,blocks", REUSE_CASES)
def test_same_image_reuses_blocks_a_different_one_never(tiny_gemma3_vl, text, blocks):
    path, hf_model, processor = tiny_gemma3_vl
    first, other = make_image(28, 28, 7), make_image(28, 28, 8)
    with make_llm(path) as llm:   # the repeat: the same pixels, another object
        runs = reuse_runs(llm, text, [first, first.copy(), other], params())
    (tokens, reused), (again, reused_again), (different, reused_other) = runs
    assert reused == 0 and tokens == hf_greedy(hf_model, processor, text, [first])
    assert again == tokens and reused_again > 0 and blocks in (None, reused_again)
    assert different == hf_greedy(hf_model, processor, text, [other])
    if text.startswith(BOI):
        assert reused_other == 0   # every block holds or follows the image


def test_prompt_tokens_equal_gemma3_processor(tiny_gemma3_vl):
    from tllm.multimodal.processing import MultimodalProcessor
    from tllm.tokenizer import Tokenizer
    path, hf_model, processor = tiny_gemma3_vl
    ours = MultimodalProcessor(processor.image_processor, Tokenizer(processor.tokenizer),
                               hf_model.config, max_images=4)
    text, images = prompts_with_images()[2]
    token_ids, mm = ours.process(text, images)
    expected = processor(text=[text], images=images, return_tensors="pt")["input_ids"]
    assert token_ids == expected[0].tolist()
    assert [item.length for item in mm.items] == [TOKENS_PER_IMAGE] * 2


@pytest.fixture(scope="module")
def pan_and_scan_gemma3(tiny_gemma3_vl, tmp_path_factory):
    """The tiny Gemma 3 again, its image processor cropping wide and tall images into
    28-pixel-high or -wide crops (do_pan_and_scan in preprocessor_config.json)."""
    import shutil
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil)
    path, hf_model, processor = tiny_gemma3_vl
    pas_path = tmp_path_factory.mktemp("tiny_gemma3_vl_pan_and_scan")
    shutil.copytree(path, pas_path, dirs_exist_ok=True)
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=True,
                                     pan_and_scan_min_crop_size=14,
                                     pan_and_scan_max_num_crops=3,
                                     pan_and_scan_min_ratio_to_activate=1.2)
    pas_processor = Gemma3Processor(image_processor=images, tokenizer=processor.tokenizer,
                                    image_seq_length=TOKENS_PER_IMAGE)
    pas_processor.save_pretrained(pas_path)   # processor_config.json holds the image's
    return pas_path, hf_model, pas_processor


def pan_and_scan_cases():
    wide, tall, square = make_image(28, 90, 5), make_image(60, 28, 6), make_image(28, 28, 9)
    return [(f"compare {BOI} and {BOI} now", [wide, square]),
            (f"describe the picture {BOI}", [tall]),
            ("what is in this image?", [])]


def hf_pan_and_scan_inputs(processor, text: str, images: list) -> dict:
    """Gemma3Processor's own pan-and-scan defaults (256-pixel crops) override the image
    processor's: name the tiny ones."""
    return processor(text=[text], images=images or None, return_tensors="pt",
                     do_pan_and_scan=True, pan_and_scan_min_crop_size=14,
                     pan_and_scan_max_num_crops=3)


def test_pan_and_scan_prompt_tokens_equal_gemma3_processor(pan_and_scan_gemma3):
    from tllm.multimodal.processing import MultimodalProcessor
    from tllm.tokenizer import Tokenizer
    path, hf_model, processor = pan_and_scan_gemma3
    ours = MultimodalProcessor(processor.image_processor, Tokenizer(processor.tokenizer),
                               hf_model.config, max_images=4)
    text, images = pan_and_scan_cases()[0]
    token_ids, mm = ours.process(text, images)
    expected = hf_pan_and_scan_inputs(processor, text, images)
    assert len(expected["pixel_values"]) == 5   # the wide image, its 3 crops, the square
    assert token_ids == expected["input_ids"][0].tolist()
    assert [item.length for item in mm.items] == [TOKENS_PER_IMAGE] * 5


def test_pan_and_scan_greedy_matches_hf(pan_and_scan_gemma3):
    path, hf_model, processor = pan_and_scan_gemma3
    cases = pan_and_scan_cases()
    with make_llm(path) as llm:
        outputs = llm.generate(as_inputs(cases), params(), use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        inputs = hf_pan_and_scan_inputs(processor, text, images)
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1]:].tolist()
        assert output.prompt_token_ids == inputs["input_ids"][0].tolist()   # crops and all
        assert output.outputs[0].token_ids == expected, text


def test_chat_with_image_url_equals_hf(tiny_gemma3_vl):
    path, hf_model, processor = tiny_gemma3_vl
    image = make_image(42, 56, 4)
    url = image_data_url(image)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is in this image?"}]}]
    with make_llm(path) as llm:
        chat = llm.chat(messages, params(), use_tqdm=False)
    text = f"<bos>user\n{BOI}what is in this image?<eos>\n<bos>model\n"
    assert chat.outputs[0].token_ids == hf_greedy(hf_model, processor, text, [image])


def test_deterministic_mode_is_refused_at_load(tiny_gemma3_vl):
    """Its image tokens see their whole image, which the batch-invariant attention cannot
    express: refused when the engine is built, not in the middle of a step."""
    with pytest.raises(ValueError, match="deterministic"):
        LLM(str(tiny_gemma3_vl[0]), deterministic=True,
            kv_cache_config=KvCacheConfig(max_tokens=256))
