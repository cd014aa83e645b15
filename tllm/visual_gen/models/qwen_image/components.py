"""Qwen-Image's components around the denoising loop: tokenizer and text encoder (Qwen2.5-VL,
from transformers), VAE (AutoencoderKLQwenImage, from diffusers) and the transformer (ours, or
diffusers' as the reference), loaded from a diffusers folder, or built with random weights for
`dummy:` names: in the real models' shapes (benchmarks: speed does not depend on weights), or
in tiny ones (a quick try on a CPU, and the tests)."""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tllm.visual_gen.memory import count_parameters
from tllm.visual_gen.models import to_dtype
from tllm.visual_gen.schedulers import QWEN_IMAGE_SCHEDULER, FlowMatchConfig

logger = logging.getLogger(__name__)
TRANSFORMER_IMPLS = ("auto", "tllm", "diffusers")
_OUR_TRANSFORMER = "tllm.visual_gen.models.qwen_image.transformer"

# Qwen2.5-VL-7B-Instruct, the text encoder of every Qwen-Image model.
QWEN25_VL_7B = dict(
    text_config=dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [16, 24, 24]}),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
        fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653, tie_word_embeddings=False)

# Qwen-Image's VAE (diffusers' defaults are its latents_mean/std); the layered model's reads
# and writes RGBA.
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                      attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)
# The tiny shapes the tests build folders of, and dummy:qwen-image-tiny's (a CPU runs them
# in seconds): a 2-layer, 32-wide text encoder over a 400-token vocabulary, a VAE with 4x
# downsampling to 4 channels (the transformer's is TINY_CONFIG in transformer.py).
TINY_VAE = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                temperal_downsample=[False, True])
TINY_TEXT_DIM = 32
TINY_CORPUS = ("Describe the image by detailing the color, shape, size, texture, quantity, "
               "text, spatial relationships of the objects and background: a cat holding a "
               "sign that says hello world, a red fox in the snow, system user assistant")
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
DUMMY_VAE = {"qwen-image": QWEN_IMAGE_VAE,
             "qwen-image-layered": {**QWEN_IMAGE_VAE, "input_channels": 4},
             "qwen-image-tiny": {**TINY_VAE, "latents_mean": [0.0] * 4,
                                 "latents_std": [1.0] * 4}}

# Text for the dummy tokenizer's merges: prompts then tokenize to a realistic-ish length.
_DUMMY_CORPUS = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background: system user assistant. A photo of a cat "
    "holding a sign that says hello world, in a city street at night with neon lights, a "
    "portrait, a landscape with mountains, rivers, trees and a blue sky, highly detailed.")


@dataclass
class QwenImageComponents:
    tokenizer: Any
    text_encoder: nn.Module
    vae: nn.Module
    transformer: nn.Module
    scheduler_config: FlowMatchConfig
    processor: Any = None       # the layered model's image+text processor, for captions


def load_components(path: str | Path, dtype: torch.dtype, device: torch.device,
                    transformer_impl: str = "auto") -> QwenImageComponents:
    """The components of a diffusers-format folder (model_index.json and one folder each)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(path / "text_encoder"), dtype=dtype)
    vae = AutoencoderKLQwenImage.from_pretrained(str(path / "vae"), torch_dtype=dtype)
    transformer = load_transformer(path / "transformer", dtype, device, transformer_impl)
    scheduler_config = FlowMatchConfig.from_model_dir(path, QWEN_IMAGE_SCHEDULER)
    processor = None
    if (path / "processor").is_dir():
        try:
            processor = AutoProcessor.from_pretrained(str(path / "processor"))
        except Exception as exc:    # e.g. transformers' video processor needs torchvision
            logger.warning("no automatic captions: the processor did not load (%s: %s)",
                           type(exc).__name__, exc)
    return QwenImageComponents(tokenizer, text_encoder.to(device).eval(),
                               vae.to(device).eval(), transformer, scheduler_config, processor)


def load_transformer(path: Path, dtype: torch.dtype, device: torch.device,
                     impl: str = "auto") -> nn.Module:
    """Our transformer ("tllm"; "auto" when it is installed) or diffusers' ("diffusers")."""
    if _pick_impl(impl) == "tllm":
        from tllm.visual_gen.models.qwen_image.transformer import QwenImageTransformer
        return QwenImageTransformer.from_pretrained(path, dtype=dtype, device=device).eval()
    from tllm.visual_gen.models.qwen_image.diffusers_transformer import (
        DiffusersQwenImageTransformer)
    return DiffusersQwenImageTransformer.from_pretrained(path, dtype=dtype, device=device)


def dummy_components(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     transformer_impl: str = "auto") -> QwenImageComponents:
    """Random components in the shapes of `name`: "qwen-image" and "qwen-image-layered" are
    the real models' (the 7B text encoder and the VAE as well as the 20B transformer, so they
    need a GPU), "qwen-image-tiny" the tests' tiny ones. The tokenizer is a small byte-level
    BPE (the real one cannot be built offline)."""
    if _pick_impl(transformer_impl) != "tllm":
        raise ValueError("dummy models need tllm's Qwen-Image transformer "
                         f"({_OUR_TRANSFORMER}), which is not available")
    from tllm.visual_gen.models.qwen_image import transformer as ours

    tokenizer = dummy_tokenizer(name)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        text_encoder, vae = _dummy_encoder_and_vae(name, tokenizer, dtype, device)
    with torch.device("meta"):      # 20B parameters: allocate them once, in dtype
        transformer = ours.QwenImageTransformer(ours.dummy_transformer_config(name))
    transformer = transformer.to(dtype=dtype).to_empty(device=device)
    ours.init_dummy_weights(transformer, seed)
    return QwenImageComponents(tokenizer, text_encoder.eval(), vae.eval(), transformer.eval(),
                               QWEN_IMAGE_SCHEDULER)


def dummy_parameter_count(name: str) -> int:
    """The parameters dummy_components(name) allocates, counted on modules built on the meta
    device (no memory, a fraction of a second)."""
    from tllm.visual_gen.models.qwen_image import transformer as ours

    meta = torch.device("meta")
    with meta:
        modules = [*_dummy_encoder_and_vae(name, dummy_tokenizer(name), torch.float32, meta),
                   ours.QwenImageTransformer(ours.dummy_transformer_config(name))]
    return count_parameters(modules)


def dummy_tokenizer(name: str):
    """The tiny models' 400-token vocabulary (with the vision tokens), or a 1024-token one."""
    if name == "qwen-image-tiny":
        return tiny_tokenizer()
    return byte_level_tokenizer(_DUMMY_CORPUS, vocab_size=1024)


def tiny_tokenizer():
    """The tiny models' tokenizer: a 400-token byte-level BPE, and the vision tokens."""
    tokenizer = byte_level_tokenizer(TINY_CORPUS, vocab_size=400)
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    return tokenizer


def tiny_text_encoder_config(tokenizer):
    """A 2-layer, TINY_TEXT_DIM-wide Qwen2.5-VL (a 1-block vision tower) over `tokenizer`."""
    from transformers import Qwen2_5_VLConfig

    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start", "image", "vision_end", "video"), VISION_TOKENS)}
    vocab_size = len(tokenizer)
    return Qwen2_5_VLConfig(
        **ids, vocab_size=vocab_size,
        text_config=dict(hidden_size=TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab_size,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=TINY_TEXT_DIM))


def _dummy_encoder_and_vae(name: str, tokenizer, dtype: torch.dtype,
                           device: torch.device) -> tuple[nn.Module, nn.Module]:
    """The text encoder and VAE of dummy `name`, random, built on `device`."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if name not in DUMMY_VAE:
        raise ValueError(f"unknown Qwen-Image dummy {name!r}; choose one of "
                         f"{', '.join(sorted(DUMMY_VAE))}")
    config = (tiny_text_encoder_config(tokenizer) if name == "qwen-image-tiny"
              else Qwen2_5_VLConfig(**QWEN25_VL_7B))
    with torch.device(device):
        text_encoder = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
        vae = to_dtype(AutoencoderKLQwenImage(**DUMMY_VAE[name]), dtype)
    return text_encoder, vae


def byte_level_tokenizer(corpus: str, vocab_size: int):
    """A Qwen2Tokenizer (byte-level BPE with Qwen's chat special tokens) trained on `corpus`;
    for dummy models and tests, where the real tokenizer is not at hand."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([corpus], trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    return tokenizer


def has_tllm_transformer() -> bool:
    return importlib.util.find_spec(_OUR_TRANSFORMER) is not None


def _pick_impl(impl: str) -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "tllm" if has_tllm_transformer() else "diffusers"
    return impl
