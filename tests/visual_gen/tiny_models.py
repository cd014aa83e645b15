"""Tiny random Qwen-Image and Qwen-Image-Layered models, built in-process and saved as
diffusers-format folders (model_index.json, one folder per component), so that our VisualGen
and diffusers' pipelines load the very same weights."""
from __future__ import annotations

from pathlib import Path

import torch

from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

CORPUS = ("Describe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background: a cat holding a sign that "
          "says hello world, a red fox in the snow, system user assistant")
TEXT_DIM = 32
SCHEDULER = dict(base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                 shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential")


VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
MAX_CAPTION_PIXELS = 28 * 28 * 16


def text_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    vocab_size = len(tokenizer)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           [("vision_start", "<|vision_start|>"), ("image", "<|image_pad|>"),
            ("vision_end", "<|vision_end|>"), ("video", "<|video_pad|>")]}
    config = Qwen2_5_VLConfig(**ids,
        text_config=dict(hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab_size,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=TEXT_DIM),
        vocab_size=vocab_size)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def save_tiny_model(path: Path, layered: bool = False, seed: int = 0) -> Path:
    """Build and save a tiny model; returns its folder."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImageLayeredPipeline, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    torch.manual_seed(seed)
    tokenizer = byte_level_tokenizer(CORPUS, vocab_size=400)
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    z_dim = 8 if layered else 4     # the layered pipeline tells images from latents by this
    if layered:     # 16x downsampling keeps diffusers' smallest bucket (640) small
        vae_shape = dict(base_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
                         temperal_downsample=[False, True, True, True], input_channels=4)
    else:
        vae_shape = dict(base_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                         temperal_downsample=[False, True])
    vae = AutoencoderKLQwenImage(
        z_dim=z_dim, **vae_shape,
        latents_mean=torch.randn(z_dim).tolist(),
        latents_std=(torch.rand(z_dim) + 0.5).tolist()).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(8, 4, 4), use_additional_t_cond=layered,
        use_layer3d_rope=layered).eval()
    components = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                      text_encoder=text_encoder(tokenizer), tokenizer=tokenizer,
                      transformer=transformer)
    if layered:
        QwenImageLayeredPipeline(**components, processor=None).save_pretrained(path)
    else:
        QwenImagePipeline(**components).save_pretrained(path)
    return Path(path)


def diffusers_pipeline(path: Path, layered: bool = False):
    from diffusers import QwenImageLayeredPipeline, QwenImagePipeline
    if layered:
        pipe = QwenImageLayeredPipeline.from_pretrained(path, processor=None)
    else:
        pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TinyVLProcessor:
    """Stands in for Qwen2VLProcessor, which transformers cannot build without torchvision:
    the same outputs (pixel patches from Qwen2VLImageProcessorPil; the prompt with
    <|image_pad|> repeated once per merged patch), small images. Captions go through it in
    both pipelines alike."""

    def __init__(self, tokenizer) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        self.tokenizer = tokenizer
        self.images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4,
                                               max_pixels=MAX_CAPTION_PIXELS)

    def __call__(self, text: str, images, padding: bool = True, return_tensors: str = "pt"):
        from transformers import BatchFeature
        vision = self.images(images=[images], return_tensors=return_tensors)
        merge = self.images.merge_size ** 2
        num_tokens = int(vision["image_grid_thw"][0].prod()) // merge
        text = text.replace("<|image_pad|>", "<|image_pad|>" * num_tokens)
        return BatchFeature({**self.tokenizer(text, return_tensors=return_tensors), **vision})

    def batch_decode(self, *args, **kwargs) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)
