"""The LTX-2 transformer's configuration: diffusers' `LTX2VideoTransformer3DModel` config (same
names and defaults, which are LTX-2.0's 19B shapes), with the options this implementation
does not run refused at load."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

# LTX-2.3/2.5 features: gated attention, prompt modulation, perturbed (STG) attention, ...
_UNSUPPORTED = {"gated_attn": False, "audio_gated_attn": False, "cross_attn_mod": False,
                "audio_cross_attn_mod": False, "perturbed_attn": False,
                "use_prompt_embeddings": True, "use_keyframes_abs_pos_embedding": False,
                "norm_elementwise_affine": False, "qk_norm": "rms_norm_across_heads",
                "activation_fn": "gelu-approximate"}


@dataclass(frozen=True)
class LTX2Config:
    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    num_layers: int = 48
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "split"
    ff_bias: bool = True
    audio_ff_bias: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "vae_scale_factors", tuple(self.vae_scale_factors))
        if self.rope_type not in ("interleaved", "split"):
            raise ValueError(f"rope_type must be 'interleaved' or 'split', got "
                             f"{self.rope_type!r}")
        if self.audio_num_attention_heads * self.audio_attention_head_dim != (
                self.audio_cross_attention_dim):
            raise ValueError("audio_cross_attention_dim must equal the audio attention width")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def video_out_channels(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def audio_channels_out(self) -> int:
        return self.audio_out_channels or self.audio_in_channels

    @classmethod
    def from_dict(cls, d: Mapping) -> LTX2Config:
        """From a diffusers config.json; ValueError for the LTX-2.x options not run here."""
        wrong = {k: d[k] for k, v in _UNSUPPORTED.items() if k in d and d[k] != v}
        if wrong:
            raise ValueError(f"LTX-2 transformer options not supported: {wrong}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    def to_diffusers(self) -> dict:
        return {**dataclasses.asdict(self), **_UNSUPPORTED}
