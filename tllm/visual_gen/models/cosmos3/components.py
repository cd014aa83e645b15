"""Cosmos 3's components: the text tokenizer (its chat template; the transformer embeds the
tokens itself, there is no separate text encoder), the transformer (ours, or diffusers' as the
reference), the Wan 2.2 VAE (AutoencoderKLWan, from diffusers) and the UniPC scheduler's
config; loaded from a diffusers folder, or built with random weights in the real shapes for
`dummy:cosmos` (benchmarks: speed does not depend on weights)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tllm.visual_gen.memory import count_parameters
from tllm.visual_gen.models.cosmos3.transformer import (Cosmos3Config, Cosmos3Transformer,
                                                        init_dummy_weights)
from tllm.visual_gen.unipc import UniPCConfig

TRANSFORMER_IMPLS = ("auto", "tllm", "diffusers")
# Cosmos 3's flow schedule (the real folder's scheduler_config.json wins when there is one).
COSMOS3_SCHEDULER = UniPCConfig(flow_shift=5.0, solver_order=2)
# The Wan 2.2 VAE (16x spatial, 4x temporal, 48 latent channels), Cosmos 3's.
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                 num_res_blocks=2, temperal_downsample=[False, True, True], is_residual=True,
                 in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                 scale_factor_temporal=4)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_DUMMY_CORPUS = ("You are a helpful assistant who will generate videos from a give prompt. "
                 "The video is seconds long and is of FPS. This video is of resolution. "
                 "A robot arm picks up a red cube on a table, a car drives down a street.")


@dataclass
class Cosmos3Components:
    tokenizer: Any
    transformer: nn.Module
    vae: nn.Module
    scheduler_config: UniPCConfig
    use_native_flow_schedule: bool = False
    default_use_system_prompt: bool = True


def load_components(path: str | Path, dtype: torch.dtype, device: torch.device,
                    transformer_impl: str = "auto") -> Cosmos3Components:
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer

    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(path / "text_tokenizer"))
    vae = AutoencoderKLWan.from_pretrained(str(path / "vae"), torch_dtype=dtype)
    transformer = load_transformer(path / "transformer", dtype, device, transformer_impl)
    return Cosmos3Components(
        tokenizer, transformer, vae.to(device).eval(),
        UniPCConfig.from_model_dir(path, COSMOS3_SCHEDULER),
        bool(index.get("use_native_flow_schedule", False)),
        bool(index.get("default_use_system_prompt", True)))


def load_transformer(path: Path, dtype: torch.dtype, device: torch.device,
                     impl: str = "auto") -> nn.Module:
    if pick_impl(impl) == "diffusers":
        from tllm.visual_gen.models.cosmos3.diffusers_transformer import DiffusersCosmos3
        return DiffusersCosmos3.from_pretrained(path, dtype, device)
    return Cosmos3Transformer.from_pretrained(path, dtype, device)


def dummy_components(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     transformer_impl: str = "auto") -> Cosmos3Components:
    """Random weights in Cosmos3-Nano's shapes (the transformer) and the Wan 2.2 VAE's."""
    _check_dummy_name(name)
    tokenizer = chat_tokenizer(_DUMMY_CORPUS, vocab_size=2000)
    with torch.device("meta"):      # allocated once, in dtype, on the device
        transformer = Cosmos3Transformer(Cosmos3Config())
    transformer = transformer.to(dtype).to_empty(device=device)
    init_dummy_weights(transformer, seed)
    if pick_impl(transformer_impl) == "diffusers":
        from tllm.visual_gen.models.cosmos3.diffusers_transformer import DiffusersCosmos3
        transformer = DiffusersCosmos3.from_ours(transformer)
    torch.manual_seed(seed)
    vae = _dummy_vae()
    return Cosmos3Components(tokenizer, transformer.eval(), vae.to(device, dtype).eval(),
                             COSMOS3_SCHEDULER)


def dummy_parameter_count(name: str) -> int:
    """The parameters dummy_components(name) allocates, counted on the meta device."""
    _check_dummy_name(name)
    with torch.device("meta"):
        return count_parameters([Cosmos3Transformer(Cosmos3Config()), _dummy_vae()])


def _dummy_vae() -> nn.Module:
    from diffusers import AutoencoderKLWan
    return AutoencoderKLWan(**WAN22_VAE, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


def _check_dummy_name(name: str) -> None:
    if name != "cosmos":
        raise ValueError(f"unknown Cosmos 3 dummy {name!r}")


def chat_tokenizer(corpus: str, vocab_size: int):
    """A small byte-level BPE tokenizer with ChatML turns and Cosmos 3's special tokens."""
    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer
    tokenizer = byte_level_tokenizer(corpus, vocab_size=vocab_size)
    tokenizer.add_tokens(["<|vision_start|>", "<|endoftext|>"], special_tokens=True)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def pick_impl(impl: str) -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {impl!r}")
    return "diffusers" if impl == "diffusers" else "tllm"
