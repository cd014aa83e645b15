"""LTX-2's components: the Gemma 3 text encoder and its tokenizer (transformers), the text
connectors, the video VAE, the audio VAE and the vocoder (diffusers), the transformer (ours,
or diffusers' as the reference) and the flow-match scheduler's config; loaded from a
diffusers folder, or built with random weights in LTX-2.0's shapes for `dummy:ltx2`
(benchmarks: speed does not depend on weights)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tllm.visual_gen.memory import count_parameters
from tllm.visual_gen.models import to_dtype
from tllm.visual_gen.models.ltx2.config import LTX2Config
from tllm.visual_gen.models.ltx2.transformer import LTX2Transformer, init_dummy_weights
from tllm.visual_gen.schedulers import FlowMatchConfig

TRANSFORMER_IMPLS = ("auto", "tllm", "diffusers")
# LTX-2's scheduler_config.json (the real folder's file wins when there is one).
LTX2_SCHEDULER = FlowMatchConfig(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                 base_image_seq_len=1024, max_image_seq_len=4096,
                                 shift_terminal=0.1)
# Gemma-3-12B's text model (the vision tower is never run for text-to-video: a small one).
GEMMA3_12B_TEXT = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       vocab_size=262208, sliding_window=1024, query_pre_attn_scalar=256,
                       max_position_embeddings=131072)
SMALL_VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, image_size=28, patch_size=14)
# diffusers' conversion script's LTX-2.0 configs.
LTX2_CONNECTORS = dict(caption_channels=3840, text_proj_in_factor=49,
                       video_connector_num_attention_heads=30,
                       video_connector_attention_head_dim=128, video_connector_num_layers=2,
                       video_connector_num_learnable_registers=128,
                       audio_connector_num_attention_heads=30,
                       audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
                       audio_connector_num_learnable_registers=128,
                       connector_rope_base_seq_len=4096, rope_theta=10000.0,
                       rope_double_precision=True, causal_temporal_positioning=False,
                       rope_type="split")
LTX2_VIDEO_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(256, 512, 1024, 2048),
    decoder_block_out_channels=(256, 512, 1024), layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5), spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True), upsample_factor=(2, 2, 2),
    timestep_conditioning=False, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6,
    encoder_causal=True, decoder_causal=False, encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect", spatial_compression_ratio=32,
    temporal_compression_ratio=8)
LTX2_AUDIO_VAE = dict(base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2,
                      attn_resolutions=None, in_channels=2, resolution=256, latent_channels=8,
                      norm_type="pixel", causality_axis="height", dropout=0.0,
                      mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
                      is_causal=True, mel_bins=64, double_z=True)
LTX2_VOCODER = dict(in_channels=128, hidden_channels=1024, out_channels=2,
                    upsample_kernel_sizes=[16, 15, 8, 4, 4], upsample_factors=[6, 5, 2, 2, 2],
                    resnet_kernel_sizes=[3, 7, 11], resnet_dilations=[[1, 3, 5]] * 3,
                    leaky_relu_negative_slope=0.1, output_sampling_rate=24000)
_DUMMY_CORPUS = ("A woman with long brown hair smiles at another woman in a black jacket, the "
                 "camera close up on her face, warm natural light of the setting sun, waves on "
                 "a beach, a dog runs, worst quality, inconsistent motion, blurry, jittery.")


@dataclass
class LTX2Components:
    tokenizer: Any
    text_encoder: nn.Module
    connectors: nn.Module
    transformer: nn.Module
    vae: nn.Module
    audio_vae: nn.Module
    vocoder: nn.Module
    scheduler_config: FlowMatchConfig


def load_components(path: str | Path, dtype: torch.dtype, device: torch.device,
                    transformer_impl: str = "auto") -> LTX2Components:
    import transformers
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, vocoder as vocoders

    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    encoder_cls = getattr(transformers, index["text_encoder"][1])
    text_encoder = encoder_cls.from_pretrained(str(path / "text_encoder"), dtype=dtype)
    connectors = LTX2TextConnectors.from_pretrained(str(path / "connectors"), torch_dtype=dtype)
    vae = AutoencoderKLLTX2Video.from_pretrained(str(path / "vae"), torch_dtype=dtype)
    audio_vae = AutoencoderKLLTX2Audio.from_pretrained(str(path / "audio_vae"),
                                                       torch_dtype=dtype)
    vocoder_cls = getattr(vocoders, index["vocoder"][1])
    vocoder = vocoder_cls.from_pretrained(str(path / "vocoder"), torch_dtype=dtype)
    transformer = load_transformer(path / "transformer", dtype, device, transformer_impl)
    modules = [m.to(device).eval() for m in (text_encoder, connectors, vae, audio_vae, vocoder)]
    return LTX2Components(tokenizer, modules[0], modules[1], transformer, *modules[2:],
                          FlowMatchConfig.from_model_dir(path, LTX2_SCHEDULER))


def load_transformer(path: Path, dtype: torch.dtype, device: torch.device,
                     impl: str = "auto") -> nn.Module:
    if pick_impl(impl) == "diffusers":
        from tllm.visual_gen.models.ltx2.diffusers_transformer import DiffusersLTX2
        return DiffusersLTX2.from_pretrained(path, dtype, device)
    return LTX2Transformer.from_pretrained(path, dtype, device)


def dummy_components(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     transformer_impl: str = "auto") -> LTX2Components:
    """Random weights in LTX-2.0's shapes: the 19B transformer, Gemma-3-12B's text model,
    the connectors, both VAEs and the vocoder (it needs a GPU)."""
    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

    _check_dummy_name(name)
    tokenizer = byte_level_tokenizer(_DUMMY_CORPUS, vocab_size=1024)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        text_encoder, connectors, vae, audio_vae, vocoder = _dummy_side_modules(dtype, device)
    with torch.device("meta"):      # 19B parameters: allocated once, in dtype, on the device
        transformer = LTX2Transformer(LTX2Config())
    transformer = transformer.to(dtype).to_empty(device=device)
    init_dummy_weights(transformer, seed)
    if pick_impl(transformer_impl) == "diffusers":
        from tllm.visual_gen.models.ltx2.diffusers_transformer import DiffusersLTX2
        transformer = DiffusersLTX2.from_ours(transformer)
    return LTX2Components(tokenizer, text_encoder.eval(), connectors.eval(), transformer.eval(),
                          vae.eval(), audio_vae.eval(), vocoder.eval(), LTX2_SCHEDULER)


def dummy_parameter_count(name: str) -> int:
    """The parameters dummy_components(name) allocates, counted on the meta device."""
    _check_dummy_name(name)
    meta = torch.device("meta")
    with meta:
        modules = [*_dummy_side_modules(torch.float32, meta), LTX2Transformer(LTX2Config())]
    return count_parameters(modules)


def _dummy_side_modules(dtype: torch.dtype, device: torch.device) -> list[nn.Module]:
    """The text encoder, connectors, video VAE, audio VAE and vocoder, random, on `device`."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    with torch.device(device):
        config = Gemma3Config(text_config=GEMMA3_12B_TEXT, vision_config=SMALL_VISION,
                              mm_tokens_per_image=4)
        return [Gemma3ForConditionalGeneration._from_config(config, dtype=dtype),
                to_dtype(LTX2TextConnectors(**LTX2_CONNECTORS), dtype),
                to_dtype(AutoencoderKLLTX2Video(**LTX2_VIDEO_VAE), dtype),
                to_dtype(AutoencoderKLLTX2Audio(**LTX2_AUDIO_VAE), dtype),
                to_dtype(LTX2Vocoder(**LTX2_VOCODER), dtype)]


def _check_dummy_name(name: str) -> None:
    if name != "ltx2":
        raise ValueError(f"unknown LTX-2 dummy {name!r}")


def pick_impl(impl: str) -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {impl!r}")
    return "diffusers" if impl == "diffusers" else "tllm"
