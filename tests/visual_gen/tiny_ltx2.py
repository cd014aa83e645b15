"""A tiny random LTX-2 (joint video+audio transformer, Gemma 3 text encoder, text connectors,
video VAE, audio VAE and vocoder), built in-process and saved as a diffusers folder, so that
our VisualGen and diffusers' LTX2Pipeline load the very same weights. Shapes follow diffusers'
own LTX-2 test components."""
from __future__ import annotations

from pathlib import Path

import torch

from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

CORPUS = ("a robot dancing in the rain, a red fox runs in the snow, waves crash on the rocks, "
          "blurry, low quality, jittery, distorted")
MAX_TEXT_TOKENS = 16        # the tokenizer's model_max_length: our pipeline's prompt length
TEXT_DIM = 32
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                 base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)


def tiny_tokenizer():
    tokenizer = byte_level_tokenizer(CORPUS, vocab_size=300)
    tokenizer.model_max_length = MAX_TEXT_TOKENS
    return tokenizer


def tiny_text_encoder(tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    config = Gemma3Config(
        text_config=dict(hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         vocab_size=len(tokenizer), sliding_window=8, pad_token_id=0,
                         bos_token_id=0, eos_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_transformer_config(**overrides) -> dict:
    config = dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
                  num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                  audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
                  audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
                  caption_channels=TEXT_DIM, rope_double_precision=False, rope_type="split")
    return {**config, **overrides}


def tiny_transformer(**overrides):
    from diffusers import LTX2VideoTransformer3DModel
    model = LTX2VideoTransformer3DModel(**tiny_transformer_config(**overrides)).eval()
    with torch.no_grad():       # the QK norms away from their init values
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def tiny_connectors(registers: int | None = None):
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    return LTX2TextConnectors(
        caption_channels=TEXT_DIM, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=registers,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=registers,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split").eval()


def tiny_vae():
    from diffusers import AutoencoderKLLTX2Video
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
        decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    with torch.no_grad():       # latent statistics away from (0, 1)
        vae.latents_mean.copy_(torch.randn_like(vae.latents_mean) * 0.3)
        vae.latents_std.copy_(torch.rand_like(vae.latents_std) + 0.5)
    return vae


def tiny_audio_vae():
    from diffusers import AutoencoderKLLTX2Audio
    vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1,
        attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
        norm_type="pixel", causality_axis="height", dropout=0.0, mid_block_add_attention=False,
        sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8).eval()
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn_like(vae.latents_mean) * 0.3)
        vae.latents_std.copy_(torch.rand_like(vae.latents_std) + 0.5)
    return vae


def tiny_vocoder():
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    return LTX2Vocoder(in_channels=16, hidden_channels=32, out_channels=2,
                       upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                       resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                       leaky_relu_negative_slope=0.1, output_sampling_rate=16000).eval()


def save_tiny_ltx2(path: Path, seed: int = 0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=tiny_vae(),
        audio_vae=tiny_audio_vae(), text_encoder=tiny_text_encoder(tokenizer),
        tokenizer=tokenizer, connectors=tiny_connectors(), transformer=tiny_transformer(),
        vocoder=tiny_vocoder())
    pipe.save_pretrained(path)
    return Path(path)


def diffusers_ltx2(path: Path):
    from diffusers import LTX2Pipeline
    pipe = LTX2Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe
