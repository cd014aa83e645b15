"""LLaVA-OneVision with images (tiny, random, fp32; SigLIP tower, Qwen2 decoder, anyres
tiles with the image newline, pooled past anyres_max_2): greedy tokens equal HF
transformers' for prompts with 0, 1 and 2 images of different sizes in one continuous batch
with text-only requests, prefill chunks cutting through the images, prefix reuse on and
off; the same image reuses cached blocks, a different image does not; the prompt tokens
equal transformers' LlavaOnevisionProcessor's."""
from __future__ import annotations

import pytest
import torch

from tests.multimodal.conftest import (make_image, older_checkpoint_name, reuse_runs,
                                       tiny_tokenizer)
from tests.multimodal.test_gemma3_vl import as_inputs, hf_greedy, make_llm, params

TILE, PATCH = 28, 14          # 2 x 2 patches a tile
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
ASPECT = "anyres_max_2"      # grids of more than about 2 tiles are pooled


def tiny_onevision_processor(tokenizer):
    """transformers' LlavaOnevisionProcessor without its video processor (which needs
    torchvision): the image token counting is the processor's own."""
    from transformers import LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    class ImagesOnlyProcessor(LlavaOnevisionProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    images = LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                             image_grid_pinpoints=PINPOINTS)
    return ImagesOnlyProcessor(image_processor=images, tokenizer=tokenizer,
                               num_image_tokens=(TILE // PATCH) ** 2,
                               vision_feature_select_strategy="full",
                               vision_aspect_ratio=ASPECT)


def tiny_onevision_config(tokenizer):
    from transformers import LlavaOnevisionConfig
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
                bos_token_id=None, pad_token_id=0)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
                  patch_size=PATCH, vision_use_head=False)
    return LlavaOnevisionConfig(text_config=text, vision_config=vision,
                                image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                vision_feature_select_strategy="full", vision_feature_layer=-1,
                                image_grid_pinpoints=PINPOINTS, vision_aspect_ratio=ASPECT,
                                architectures=["LlavaOnevisionForConditionalGeneration"])


@pytest.fixture(scope="module")
def tiny_onevision(tmp_path_factory):
    """(folder, HF model, processor) of a tiny random LLaVA-OneVision."""
    from transformers import LlavaOnevisionForConditionalGeneration
    path = tmp_path_factory.mktemp("tiny_llava_onevision")
    tokenizer = tiny_tokenizer()
    processor = tiny_onevision_processor(tokenizer)
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(tiny_onevision_config(tokenizer)).eval()
    model.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, processor


def prompts_with_images():
    """A square image (a 1 x 1 grid after its base tile), a wide one (1 x 3, its padding
    rows cropped) and a larger one (2 x 2); the last two are pooled (anyres_max_2)."""
    return [("<image>\ndescribe the picture", [make_image(28, 28, 1)]),
            ("what is in this image?", []),
            ("compare <image> and <image> now", [make_image(30, 70, 2), make_image(60, 50, 3)]),
            ("the quick brown fox jumps over the lazy dog", [])]


@pytest.mark.parametrize("enable_block_reuse,max_num_tokens", [(True, 128), (False, 128),
                                                               (True, 8)])
def test_greedy_matches_hf_in_continuous_batch(tiny_onevision, enable_block_reuse,
                                               max_num_tokens):
    """max_num_tokens=8: prefill chunks cut through the images."""
    path, hf_model, processor = tiny_onevision
    cases = prompts_with_images()
    with make_llm(path, enable_block_reuse, max_num_tokens) as llm:
        outputs = llm.generate(as_inputs(cases), params(), use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images)


@pytest.mark.parametrize("text", ["<image>describe the picture in a few words",
                                  "a red square and a blue circle, <image>"])
def test_same_image_reuses_blocks_a_different_one_never(tiny_onevision, text):
    path, hf_model, processor = tiny_onevision
    first, other = make_image(42, 56, 7), make_image(42, 56, 8)
    with make_llm(path) as llm:   # the repeat: the same pixels, another object
        runs = reuse_runs(llm, text, [first, first.copy(), other], params())
    (tokens, reused), (again, reused_again), (different, reused_other) = runs
    assert reused == 0 and tokens == hf_greedy(hf_model, processor, text, [first])
    assert again == tokens and reused_again > 0
    assert different == hf_greedy(hf_model, processor, text, [other])
    if text.startswith("<image>"):
        assert reused_other == 0   # every block holds or follows the image


def test_prompt_tokens_equal_onevision_processor(tiny_onevision):
    from tllm.multimodal.processing import MultimodalProcessor
    from tllm.tokenizer import Tokenizer
    path, hf_model, processor = tiny_onevision
    ours = MultimodalProcessor(processor.image_processor, Tokenizer(processor.tokenizer),
                               hf_model.config, max_images=4)
    for text, images in prompts_with_images():
        token_ids, mm = ours.process(text, images)
        expected = processor(text=[text], images=images or None, return_tensors="pt")
        assert token_ids == expected["input_ids"][0].tolist()
        # the base tile and the grid's tiles, without the batch's padding tiles
        assert [len(item.data["pixel_values"]) for item in mm.items] == {
            1: [2], 2: [4, 5]}.get(len(images), [])


def test_default_feature_strategy_is_refused(tiny_onevision):
    from tllm.models.llava_onevision import LlavaOnevisionForConditionalGeneration
    config = tiny_onevision_config(tiny_tokenizer())
    config.vision_feature_select_strategy = "default"
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        LlavaOnevisionForConditionalGeneration(config, None, 64)


def test_older_checkpoint_layout_loads(tiny_onevision):
    """The hub's llava-onevision files name tensors the older way (image_newline at the
    top)."""
    import copy

    from tllm.attention.torch_ref import TorchAttentionBackend
    from tllm.models.llava_onevision import LlavaOnevisionForConditionalGeneration
    hf_model = tiny_onevision[1]
    ours = LlavaOnevisionForConditionalGeneration(copy.deepcopy(hf_model.config),
                                                  TorchAttentionBackend, 64)
    weights = [(older_checkpoint_name(n), t) for n, t in hf_model.state_dict().items()]
    assert ours.expected_weights() <= ours.load_weights(weights)
    assert torch.equal(ours.image_newline, hf_model.model.image_newline)
    assert torch.equal(ours.multi_modal_projector.linear_2.weight,
                       hf_model.model.multi_modal_projector.linear_2.weight)
    assert torch.equal(ours.lm_head.weight, hf_model.lm_head.weight)
