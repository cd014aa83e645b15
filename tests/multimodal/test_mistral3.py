"""Mistral 3 with images (tiny, random, fp32; Pixtral tower, patch merger, Mistral decoder):
greedy tokens equal HF transformers' Mistral3ForConditionalGeneration for prompts with 0, 1
and 2 images of different sizes in one continuous batch with text-only requests, with
prefill chunks cutting through the images and prefix reuse on and off; the same image
reuses cached blocks, a different image does not; the prompt tokens ([IMG] rows ending in
[IMG_BREAK], the last in [IMG_END]) equal transformers' PixtralProcessor's."""
from __future__ import annotations

import pytest
import torch

from tests.multimodal.conftest import (image_data_url, make_image, older_checkpoint_name,
                                       reuse_runs, tiny_tokenizer)
from tests.multimodal.test_gemma3_vl import as_inputs, hf_greedy, make_llm, params

IMG, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
SPECIAL = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", IMG, BREAK, END]
CHAT_TEMPLATE = (  # Mistral's turns, with an image part written as [IMG]
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST]"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}[IMG]"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
PATCH, MERGE, LONGEST_EDGE = 7, 2, 56   # an image token covers 14 x 14 pixels


def tiny_pixtral_processor(tokenizer):
    """transformers' PixtralProcessor (its image layout is the processor's own)."""
    import transformers.models.pixtral.image_processing_pil_pixtral as pil
    images = pil.PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                          patch_size={"height": PATCH, "width": PATCH})
    processor_cls = pixtral_processor_class()
    return processor_cls(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                         spatial_merge_size=MERGE)


def pixtral_processor_class():
    """PixtralProcessor. Its module imports a resize helper from the torchvision image
    processor's module; without torchvision, the PIL image processor's module lends it
    the same function while it is imported."""
    import sys
    import types
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        return PixtralProcessor
    except ImportError:
        pass
    import transformers.models.pixtral.image_processing_pil_pixtral as pil
    name = "transformers.models.pixtral.image_processing_pixtral"
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].get_resize_output_image_size = pil.get_resize_output_image_size
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        del sys.modules[name]
    return PixtralProcessor


def tiny_mistral3_config(tokenizer):
    from transformers import Mistral3Config
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                sliding_window=None, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, image_size=LONGEST_EDGE,
                  patch_size=PATCH)
    return Mistral3Config(text_config=text, vision_config=vision,
                          image_token_index=tokenizer.convert_tokens_to_ids(IMG),
                          spatial_merge_size=MERGE, vision_feature_layer=-1,
                          tie_word_embeddings=False,
                          architectures=["Mistral3ForConditionalGeneration"])


@pytest.fixture(scope="module")
def tiny_mistral3(tmp_path_factory):
    """(folder, HF model, PixtralProcessor) of a tiny random Mistral 3."""
    from transformers import Mistral3ForConditionalGeneration
    path = tmp_path_factory.mktemp("tiny_mistral3")
    tokenizer = tiny_tokenizer(SPECIAL, CHAT_TEMPLATE, pad_token="<pad>")
    processor = tiny_pixtral_processor(tokenizer)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(tiny_mistral3_config(tokenizer)).eval()
    with torch.no_grad():  # HF initialises the RMS norms at 1: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, processor


def prompts_with_images():
    """Images of 2 x 2, 3 x 4 and 3 x 3 tokens (6, 15 and 12 with their breaks)."""
    return [(f"<s>[INST]{IMG}describe the picture[/INST]", [make_image(28, 28, 1)]),
            ("<s>[INST]what is in this image?[/INST]", []),
            (f"<s>[INST]compare {IMG} and {IMG} now[/INST]",
             [make_image(56, 84, 2), make_image(40, 30, 3)]),
            ("the quick brown fox jumps over the lazy dog", [])]


@pytest.mark.parametrize("enable_block_reuse,max_num_tokens", [(True, 128), (False, 128),
                                                               (True, 8)])
def test_greedy_matches_hf_in_continuous_batch(tiny_mistral3, enable_block_reuse,
                                               max_num_tokens):
    """max_num_tokens=8: prefill chunks cut through the images' rows."""
    path, hf_model, processor = tiny_mistral3
    cases = prompts_with_images()
    with make_llm(path, enable_block_reuse, max_num_tokens) as llm:
        outputs = llm.generate(as_inputs(cases), params(), use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images)


@pytest.mark.parametrize("text", [f"{IMG}describe the picture in a few words",
                                  f"a red square and a blue circle, {IMG}"])
def test_same_image_reuses_blocks_a_different_one_never(tiny_mistral3, text):
    path, hf_model, processor = tiny_mistral3
    first, other = make_image(42, 56, 7), make_image(42, 56, 8)
    with make_llm(path) as llm:   # the repeat: the same pixels, another object
        runs = reuse_runs(llm, text, [first, first.copy(), other], params())
    (tokens, reused), (again, reused_again), (different, reused_other) = runs
    assert reused == 0 and tokens == hf_greedy(hf_model, processor, text, [first])
    assert again == tokens and reused_again > 0
    assert different == hf_greedy(hf_model, processor, text, [other])
    if text.startswith(IMG):
        assert reused_other == 0   # every block holds or follows the image


def test_prompt_tokens_equal_pixtral_processor(tiny_mistral3):
    from tllm.multimodal.processing import MultimodalProcessor
    from tllm.tokenizer import Tokenizer
    path, hf_model, processor = tiny_mistral3
    ours = MultimodalProcessor(processor.image_processor, Tokenizer(processor.tokenizer),
                               hf_model.config, max_images=4)
    text, images = prompts_with_images()[2]
    token_ids, mm = ours.process(text, images)
    expected = processor(text=[text], images=images, return_tensors="pt")["input_ids"]
    assert token_ids == expected[0].tolist()
    assert [item.length for item in mm.items] == [15, 12]
    end = processor.tokenizer.convert_tokens_to_ids(END)
    assert [token_ids[item.end - 1] for item in mm.items] == [end, end]


def test_tokenizer_without_break_token_is_refused(tiny_mistral3):
    from tllm.models.mistral3 import Mistral3ForConditionalGeneration
    from tllm.tokenizer import Tokenizer
    config = tiny_mistral3[1].config
    data = {"image_sizes": torch.tensor([[28, 28]])}
    with pytest.raises(ValueError, match="IMG_BREAK"):
        Mistral3ForConditionalGeneration.placeholder_layout(data, config,
                                                            Tokenizer(tiny_tokenizer()))


def test_chat_with_image_url_equals_hf(tiny_mistral3):
    path, hf_model, processor = tiny_mistral3
    image = make_image(42, 56, 4)
    url = image_data_url(image)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is in this image?"}]}]
    with make_llm(path) as llm:
        chat = llm.chat(messages, params(), use_tqdm=False)
    text = f"<s>[INST]{IMG}what is in this image?[/INST]"
    assert chat.outputs[0].token_ids == hf_greedy(hf_model, processor, text, [image])


def test_older_checkpoint_layout_loads(tiny_mistral3):
    """The hub's Mistral-Small-3.1 files name tensors the older way."""
    import copy

    from tllm.attention.torch_ref import TorchAttentionBackend
    from tllm.models.mistral3 import Mistral3ForConditionalGeneration
    hf_model = tiny_mistral3[1]
    ours = Mistral3ForConditionalGeneration(copy.deepcopy(hf_model.config),
                                            TorchAttentionBackend, 64)
    weights = [(older_checkpoint_name(n), t) for n, t in hf_model.state_dict().items()]
    assert ours.expected_weights() <= ours.load_weights(weights)
    hf_tower = hf_model.model.vision_tower.state_dict()
    for name, tensor in ours.vision_tower.state_dict().items():
        assert torch.equal(tensor, hf_tower[name])
    projector = hf_model.model.multi_modal_projector.patch_merger.merging_layer.weight
    assert torch.equal(ours.multi_modal_projector.patch_merger.merging_layer.weight, projector)
    assert torch.equal(ours.lm_head.weight, hf_model.lm_head.weight)
