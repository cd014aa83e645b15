"""Cosmos 3's mixture-of-transformers denoiser (diffusers' `Cosmos3OmniTransformer`, our
implementation): a Qwen3-style decoder whose every layer has two sets of weights, one for the
"understanding" tokens (the prompt, causal attention among themselves) and one for the
"generation" tokens (video patches, then sound frames), whose queries attend to all keys.
Positions are 3D (time, row, column) with interleaved multimodal RoPE (rope.py).

One forward runs every guidance branch of a step together: the branches share the noisy
latents (so the generation tokens are embedded once), differ in their prompt, and each
attends within its own joint sequence; the GEMMs cover all branches at once. Loads diffusers'
checkpoints and names, fusing Q/K/V and gate/up as it loads."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tllm.layers.norm import RMSNorm
from tllm.loader.hf import CheckpointError
from tllm.visual_gen.models.checkpoint import load_named, transformer_from_folder
from tllm.visual_gen.models.cosmos3.layers import MoTLayer
from tllm.visual_gen.models.cosmos3.rope import JointLayout
from tllm.visual_gen.step_cache import BlockStack, StepCache, run_blocks

TIMESTEP_CHANNELS = 256


@dataclass(frozen=True)
class Cosmos3Config:
    """diffusers' Cosmos3OmniTransformer config (same names and defaults: Cosmos3-Nano)."""
    attention_bias: bool = False
    head_dim: int = 128
    hidden_size: int = 4096
    intermediate_size: int = 12288
    base_fps: int = 24
    enable_fps_modulation: bool = True
    latent_channel: int = 48
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    latent_patch_size: int = 2
    num_attention_heads: int = 32
    num_hidden_layers: int = 36
    num_key_value_heads: int = 8
    patch_latent_dim: int = 192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    sound_dim: int | None = None
    sound_gen: bool = False
    sound_latent_fps: float = 25.0
    timestep_scale: float = 0.001
    vocab_size: int = 151936
    hidden_act: str = "silu"
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)
    action_gen: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_axes_dim", tuple(self.rope_axes_dim))
        if self.hidden_act not in ("silu", "relu2"):
            raise ValueError(f"hidden_act must be 'silu' or 'relu2', got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if sum(self.rope_axes_dim) * 2 != self.head_dim:
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must sum to head_dim / 2")
        if self.sound_gen and not self.sound_dim:
            raise ValueError("sound_gen needs sound_dim")

    @classmethod
    def from_dict(cls, d: Mapping) -> Cosmos3Config:
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        if d.get("rope_axes_dim") is None:
            d["rope_axes_dim"] = (d.get("rope_scaling") or {}).get("mrope_section", [24, 20, 20])
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


@dataclass
class GenTokens:
    """This step's generation inputs, shared by every branch: latents (C, T, H, W) of the
    video, and (C_s, T_s) of the sound or None; the frames of the video being denoised."""
    vision: torch.Tensor
    sound: torch.Tensor | None
    noisy_frames: list[int]


class Cosmos3Transformer(nn.Module):
    """`forward(gen, timestep, layouts)` -> (video predictions (G, C, T, H, W), sound
    predictions (G, C_s, T_s) or None), one per branch layout; zero at conditioning frames."""

    supports_step_cache = True

    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(MoTLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(d, config.rms_norm_eps)
        self.proj_in = nn.Linear(config.patch_latent_dim, d)
        self.proj_out = nn.Linear(d, config.patch_latent_dim)
        self.time_linear_1 = nn.Linear(TIMESTEP_CHANNELS, d)
        self.time_linear_2 = nn.Linear(d, d)
        if config.sound_gen:
            self.audio_proj_in = nn.Linear(config.sound_dim, d)
            self.audio_proj_out = nn.Linear(d, config.sound_dim)
            self.audio_modality_embed = nn.Parameter(torch.zeros(d))
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_in.weight.device

    def forward(self, gen: GenTokens, timestep: float, layouts: list[JointLayout],
                step_cache: StepCache | None = None):
        num_branches = len(layouts)
        vision_tokens, grid = self._patchify(gen.vision.to(self.dtype))
        tokens = self.proj_in(vision_tokens)
        temb = self._timestep_embedding(timestep)
        frame_tokens = grid[1] * grid[2]
        noisy_rows = torch.cat([torch.arange(f * frame_tokens, (f + 1) * frame_tokens)
                                for f in gen.noisy_frames]).to(self.device)
        tokens = tokens.index_add(0, noisy_rows, temb.expand(len(noisy_rows), -1))
        if gen.sound is not None:
            sound = self.audio_proj_in(gen.sound.to(self.dtype).t()) + self.audio_modality_embed
            tokens = torch.cat([tokens, sound + temb])
        num_gen = tokens.shape[0]
        und = [self.embed_tokens(layout.input_ids) for layout in layouts]
        gen_h = tokens.repeat(num_branches, 1)
        state = (torch.cat(und), None, gen_h, None)
        _, _, gen_h, gen_res = run_blocks(self._block_stack(layouts), state, step_cache)
        gen_out, _ = self.norm_moe_gen(gen_h, gen_res)
        gen_out = gen_out.view(num_branches, num_gen, -1)
        vision = self._unpatchify(self.proj_out(gen_out[:, noisy_rows]), gen, grid)
        sound = None
        if gen.sound is not None:
            num_vision = vision_tokens.shape[0]
            sound = self.audio_proj_out(gen_out[:, num_vision:]).transpose(1, 2)
        return vision, sound

    def _block_stack(self, layouts: list[JointLayout]) -> BlockStack:
        """The layers over the state (und, und residual, gen, gen residual), for run_blocks;
        only the generated tokens' stream is cached (the output reads only it)."""
        def run(layers, state):
            for layer in layers:
                state = layer(*state, layouts)
            return state

        def hidden(state) -> list[torch.Tensor]:
            gen, residual = state[2:]
            return [gen if residual is None else gen + residual]

        return BlockStack(
            first=lambda state: run(self.layers[:1], state),
            rest=lambda state: run(self.layers[1:], state),
            modulated_input=lambda state: self.layers[0].input_layernorm_moe_gen(state[2]),
            hidden=hidden,
            with_residuals=lambda state, residuals: (*state[:2], residuals[0],
                                                     hidden(state)[0]))

    def _timestep_embedding(self, timestep: float) -> torch.Tensor:
        """(1, d): sinusoids (cos first) of timestep * timestep_scale through the SiLU MLP,
        in float32 as diffusers keeps it."""
        t = torch.tensor([timestep], device=self.device) * self.config.timestep_scale
        half = TIMESTEP_CHANNELS // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32,
                                                   device=self.device) / half
        args = t[:, None].float() * exponent.exp()[None, :]
        features = torch.cat([args.cos(), args.sin()], dim=-1)
        w1, w2 = self.time_linear_1, self.time_linear_2
        h = F.silu(F.linear(features, w1.weight.float(), w1.bias.float()))
        return F.linear(h, w2.weight.float(), w2.bias.float()).to(self.dtype)

    def _patchify(self, latents: torch.Tensor):
        """(C, T, H, W) -> (T * h * w, p * p * C) tokens, H and W zero-padded to p."""
        p = self.config.latent_patch_size
        c, t, h, w = latents.shape
        hp, wp = -(-h // p), -(-w // p)
        if (hp * p, wp * p) != (h, w):
            latents = F.pad(latents, (0, wp * p - w, 0, hp * p - h))
        patches = latents.reshape(c, t, hp, p, wp, p).permute(1, 2, 4, 3, 5, 0)
        return patches.reshape(t * hp * wp, p * p * c), (t, hp, wp)

    def _unpatchify(self, preds: torch.Tensor, gen: GenTokens, grid) -> torch.Tensor:
        """(G, noisy tokens, p * p * C) -> (G, C, T, H, W), zeros at conditioning frames."""
        p = self.config.latent_patch_size
        c, t, h, w = gen.vision.shape
        g, tn = preds.shape[0], len(gen.noisy_frames)
        patches = preds.reshape(g, tn, grid[1], grid[2], p, p, c).permute(0, 6, 1, 2, 4, 3, 5)
        frames = patches.reshape(g, c, tn, grid[1] * p, grid[2] * p)[..., :h, :w]
        out = preds.new_zeros(g, c, t, h, w)
        out[:, :, gen.noisy_frames] = frames
        return out

    # ---- checkpoints ----

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> Cosmos3Transformer:
        return transformer_from_folder(cls, Cosmos3Config, WeightLoader, path, dtype, device)

    def load_diffusers_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        load_named(WeightLoader(self), state_dict.items())


# diffusers module -> ours, outside the layers
_TOP = {"time_embedder.linear_1": "time_linear_1", "time_embedder.linear_2": "time_linear_2"}
# diffusers module in a layer -> (our module, slot); slots of a fused module stack by rows
_LAYER = {
    "self_attn.to_q": ("und_qkv", 0), "self_attn.to_k": ("und_qkv", 1),
    "self_attn.to_v": ("und_qkv", 2), "self_attn.add_q_proj": ("gen_qkv", 0),
    "self_attn.add_k_proj": ("gen_qkv", 1), "self_attn.add_v_proj": ("gen_qkv", 2),
    "self_attn.to_out": ("und_out", 0), "self_attn.to_add_out": ("gen_out", 0),
    "mlp.gate_proj": ("und_gate_up", 0), "mlp.up_proj": ("und_gate_up", 1),
    "mlp.down_proj": ("und_down", 0), "mlp_moe_gen.gate_proj": ("gen_gate_up", 0),
    "mlp_moe_gen.up_proj": ("gen_gate_up", 1), "mlp_moe_gen.down_proj": ("gen_down", 0),
    "self_attn.norm_q": ("und_q_norm", 0), "self_attn.norm_k": ("und_k_norm", 0),
    "self_attn.norm_added_q": ("gen_q_norm", 0), "self_attn.norm_added_k": ("gen_k_norm", 0),
    "self_attn.k_norm_und_for_gen": ("und_k_norm_for_gen", 0),
}
_SKIPPED = ("lm_head.", "action_")     # the text head and the action heads: not run here


class WeightLoader:
    """Copies diffusers-named tensors into our (fused) parameters, slot by slot, and checks at
    the end that every parameter was filled."""

    def __init__(self, model: Cosmos3Transformer) -> None:
        self.params = dict(model.named_parameters())
        self.model = model
        self.filled: dict[str, int] = {}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(_SKIPPED):
            return
        ours, rows = self._target(name)
        param = self.params.get(ours)
        if param is None:
            raise CheckpointError(f"weight {name!r} does not fit this config (no {ours})")
        target = param[rows] if rows is not None else param
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        self.filled[ours] = self.filled.get(ours, 0) + target.shape[0]

    def _target(self, name: str) -> tuple[str, slice | None]:
        if "." not in name:     # audio_modality_embed
            return name, None
        module, leaf = name.rsplit(".", 1)
        if module in _TOP:
            return f"{_TOP[module]}.{leaf}", None
        parts = module.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            local = parts[2]
            if local in _LAYER:
                ours, slot = _LAYER[local]
                layer = self.model.layers[int(parts[1])]
                rows = layer.slot_rows(ours, slot)
                suffix = "" if ours.endswith(("_norm", "_norm_for_gen")) else f".{leaf}"
                return f"layers.{parts[1]}.{ours}{suffix}", rows
            return f"{module}.{leaf}", None       # the layer norms keep diffusers' names
        return name, None

    def finish(self) -> None:
        missing = [n for n, p in self.params.items()
                   if self.filled.get(n, 0) != (p.shape[0] if p.dim() else 1)]
        if missing:
            raise CheckpointError(f"checkpoint lacks weights for {len(missing)} parameters, "
                                  f"e.g. {missing[:3]}")


@torch.no_grad()
def init_dummy_weights(model: Cosmos3Transformer, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks, generated on the model's device: norms at one, the rest
    normal(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    out_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith(("_out.weight", "_down.weight")):
            param.normal_(0.0, out_std, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)
