"""A tiny random Qwen2.5-VL in a folder with its processor (the PIL image processor and a
small BPE tokenizer with Qwen's special tokens and a chat template that renders image
parts), built in-process once per session; and tiny images."""
from __future__ import annotations

import numpy as np
import pytest
import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<image>"]
CORPUS = ["describe the picture in a few words", "what is in this image?",
          "a red square and a blue circle", "compare the two pictures",
          "the quick brown fox jumps over the lazy dog"] * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def tiny_tokenizer(special: list[str] = SPECIAL, chat_template: str = CHAT_TEMPLATE,
                   pad_token: str = "<|endoftext|>"):
    """A byte-level BPE tokenizer with these special tokens (Qwen's by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad_token)
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)


class QwenReference:
    """HF inputs as Qwen2_5_VLProcessor makes them (each <|image_pad|> of the text repeated
    to its image's merged patch count, then tokenized), built here because that processor
    needs a video processor, hence torchvision."""

    def __init__(self, image_processor, tokenizer, config) -> None:
        self.image_processor, self.tokenizer, self.config = image_processor, tokenizer, config

    def __call__(self, text: str, images: list) -> dict:
        inputs = {}
        if images:
            inputs = dict(self.image_processor(images=images, return_tensors="pt"))
            for count in (inputs["image_grid_thw"].prod(-1) // 4).tolist():
                text = text.replace("<|image_pad|>", "<|placeholder|>" * count, 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        tokens = self.tokenizer(text, return_tensors="pt")
        inputs.update(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                      mm_token_type_ids=(tokens["input_ids"]
                                         == self.config.image_token_id).int())
        return inputs


def tiny_config(tokenizer):
    from transformers import Qwen2_5_VLConfig
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>")]}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids,
                            architectures=["Qwen2_5_VLForConditionalGeneration"])


@pytest.fixture(scope="session")
def tiny_qwen_vl(tmp_path_factory):
    """(folder, HF model, QwenReference) of a tiny random Qwen2.5-VL."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    tokenizer = tiny_tokenizer()
    images = tiny_image_processor()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer)).eval()
    model.save_pretrained(path)
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, QwenReference(images, tokenizer, model.config)


def tiny_llava_config(tokenizer):
    from transformers import LlavaConfig
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
                bos_token_id=None, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                  projection_dim=32)
    return LlavaConfig(text_config=text, vision_config=vision,
                       image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       architectures=["LlavaForConditionalGeneration"])


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(folder, HF model, processor) of a tiny random LLaVA (CLIP tower, Llama decoder)."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    path = tmp_path_factory.mktemp("tiny_llava")
    tokenizer = tiny_tokenizer()
    images = CLIPImageProcessorPil(size={"shortest_edge": 28},
                                   crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(tiny_llava_config(tokenizer)).eval()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, processor


def make_image(height: int, width: int, seed: int):
    """A random RGB image (PIL) of this size."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_data_url(image) -> str:
    """The image as a PNG data: URL (an OpenAI image_url)."""
    import base64
    import io
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def reuse_runs(llm, text: str, images: list, params) -> list[tuple[list[int], int]]:
    """(greedy tokens, KV blocks reused) of `text` with each image in turn, one request
    after another on `llm`."""
    runs = []
    for image in images:
        before = llm.get_kv_cache_stats()["blocks_reused"]
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, params,
                           use_tqdm=False)
        runs.append((out.outputs[0].token_ids,
                     llm.get_kv_cache_stats()["blocks_reused"] - before))
    return runs


def older_checkpoint_name(name: str) -> str:
    """A transformers 5 checkpoint name of a LLaVA-style model in the older layout that
    many hub files still use (vision_tower.*, language_model.model.*,
    language_model.lm_head.*)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    return name.removeprefix("model.")
