"""LTX-2's joint video + audio denoiser (diffusers' `LTX2VideoTransformer3DModel`, our
implementation). `forward(inputs)` predicts the velocity of both streams for every row of the
batch (the guidance branches of one step); the prompt's projections and per-layer keys and
values come from `encode_text`, computed once per generation. Loads diffusers' checkpoints
and names, fusing Q/K/V (self-attention) and K/V (cross attention) as it loads."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tllm.loader.hf import CheckpointError
from tllm.visual_gen.models.checkpoint import load_named, transformer_from_folder
from tllm.visual_gen.models.ltx2 import blocks
from tllm.visual_gen.models.ltx2.blocks import LTX2Block, StreamState
from tllm.visual_gen.models.ltx2.config import LTX2Config
from tllm.visual_gen.models.ltx2.rope import LTX2Rope
from tllm.visual_gen.models.ltx2.stack import block_stack
from tllm.visual_gen.step_cache import StepCache, run_blocks

TIMESTEP_CHANNELS = 256


@dataclass
class TextContext:
    """The prompts of a batch as the blocks read them: per layer ((video k, v), (audio k, v)),
    and the boolean key masks [B, 1, 1, L] (None when no token is padded)."""
    layers: list
    video_mask: torch.Tensor | None
    audio_mask: torch.Tensor | None


@dataclass
class LTX2Inputs:
    """One forward: packed latents, the step's timestep per row (0..1000), the rotary tables,
    `clean_tokens` leading video tokens that are conditioning (timestep 0, image-to-video),
    `use_cross_timestep` (the cross attention's modulation follows the other stream's
    timestep, diffusers' LTX-2.3 default) and `cross_rows` [B] (1: cross attention on, 0:
    the streams isolated, for modality guidance; None: on for all); `step_cache`: see
    step_cache.py."""
    video: torch.Tensor             # [B, N_v, C]
    audio: torch.Tensor             # [B, N_a, C_a]
    timestep: torch.Tensor          # [B]
    text: TextContext
    rope: LTX2Rope
    clean_tokens: int = 0
    use_cross_timestep: bool = True
    cross_rows: torch.Tensor | None = None
    step_cache: StepCache | None = None


class TimestepModulation(nn.Module):
    """diffusers' LTX2AdaLayerNormSingle: sinusoids of the timestep (cos first) through a SiLU
    MLP (the embedding), and a linear of its SiLU (num_mods vectors)."""

    def __init__(self, dim: int, num_mods: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_CHANNELS, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.linear = nn.Linear(dim, num_mods * dim)

    def forward(self, timesteps: torch.Tensor):
        half = TIMESTEP_CHANNELS // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32,
                                                   device=timesteps.device) / half
        args = timesteps[..., None].float() * exponent.exp()
        features = torch.cat([args.cos(), args.sin()], dim=-1).to(self.linear_1.weight.dtype)
        embedded = self.linear_2(F.silu(self.linear_1(features)))
        return self.linear(F.silu(embedded)), embedded


class TextProjection(nn.Module):
    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class LTX2Transformer(nn.Module):
    supports_step_cache = True

    def __init__(self, config: LTX2Config) -> None:
        super().__init__()
        self.config = c = config
        d, ad = c.inner_dim, c.audio_inner_dim
        self.proj_in = nn.Linear(c.in_channels, d)
        self.audio_proj_in = nn.Linear(c.audio_in_channels, ad)
        self.caption_projection = TextProjection(c.caption_channels, d)
        self.audio_caption_projection = TextProjection(c.caption_channels, ad)
        self.time_embed = TimestepModulation(d, 6)
        self.audio_time_embed = TimestepModulation(ad, 6)
        self.av_cross_attn_video_scale_shift = TimestepModulation(d, 4)
        self.av_cross_attn_audio_scale_shift = TimestepModulation(ad, 4)
        self.av_cross_attn_video_a2v_gate = TimestepModulation(d, 1)
        self.av_cross_attn_audio_v2a_gate = TimestepModulation(ad, 1)
        self.scale_shift_table = nn.Parameter(torch.zeros(2, d))
        self.audio_scale_shift_table = nn.Parameter(torch.zeros(2, ad))
        self.transformer_blocks = nn.ModuleList(LTX2Block(c) for _ in range(c.num_layers))
        self.proj_out = nn.Linear(d, c.video_out_channels)
        self.audio_proj_out = nn.Linear(ad, c.audio_channels_out)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_in.weight.device

    @torch.no_grad()
    def encode_text(self, video_text: torch.Tensor, audio_text: torch.Tensor,
                    mask: torch.Tensor | None) -> TextContext:
        """Connector outputs [B, L, caption_channels] (and their [B, L] 0/1 mask) -> the
        blocks' prompt keys and values."""
        video = self.caption_projection(video_text.to(self.dtype))
        audio = self.audio_caption_projection(audio_text.to(self.dtype))
        layers = [block.text_kv(video, audio) for block in self.transformer_blocks]
        key_mask = None
        if mask is not None and not bool(mask.bool().all()):
            key_mask = mask.bool()[:, None, None, :]
        return TextContext(layers, key_mask, key_mask)

    def forward(self, inputs: LTX2Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        batch = inputs.video.shape[0]
        t = inputs.timestep.to(self.device).float()
        split = inputs.clean_tokens or None
        video_t = torch.stack([torch.zeros_like(t), t], 1) if split else t[:, None]   # [B, G]
        gate_scale = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        video_cross_t = t[:, None] if inputs.use_cross_timestep else video_t
        temb, video_emb = self.time_embed(video_t)
        temb_audio, audio_emb = self.audio_time_embed(t[:, None])
        temb_cross, _ = self.av_cross_attn_video_scale_shift(video_cross_t)
        gate_cross, _ = self.av_cross_attn_video_a2v_gate(video_cross_t * gate_scale)
        temb_cross_audio, _ = self.av_cross_attn_audio_scale_shift(t[:, None])
        gate_cross_audio, _ = self.av_cross_attn_audio_v2a_gate(t[:, None] * gate_scale)
        if split:   # one group broadcast over both token groups: stride 0
            temb_cross, gate_cross = (x.expand(-1, 2, -1) for x in (temb_cross, gate_cross))
        video = StreamState(self.proj_in(inputs.video.to(self.dtype)))
        audio = StreamState(self.audio_proj_in(inputs.audio.to(self.dtype)))
        cross_rows = None
        if inputs.cross_rows is not None:
            cross_rows = inputs.cross_rows.to(device=self.device, dtype=self.dtype)
            cross_rows = cross_rows.view(batch, 1, 1)
        embeddings = (temb, temb_audio, temb_cross, temb_cross_audio, gate_cross,
                      gate_cross_audio)
        stack = block_stack(self.transformer_blocks, embeddings, inputs.text, inputs.rope,
                            split, cross_rows)
        video, audio = run_blocks(stack, (video, audio), inputs.step_cache)
        return (self._output(video, video_emb, self.scale_shift_table, self.proj_out, split),
                self._output(audio, audio_emb, self.audio_scale_shift_table,
                             self.audio_proj_out, None))

    def _output(self, stream: StreamState, embedded: torch.Tensor, table: torch.Tensor,
                proj: nn.Linear, split: int | None) -> torch.Tensor:
        """The last gated residual, LayerNorm modulated by the table + embedding, projection."""
        y, gate = stream.pending
        if gate is None:    # a cached residual (stack.py), added as is
            gate = torch.ones_like(embedded)
        # shift, scale and gate as views of one [B, G, 3, d] tensor (the kernel's layout)
        values = torch.cat([table + embedded[:, :, None], gate[:, :, None]], dim=2)
        shift, scale, gate = values.unbind(2)
        if blocks.uses_triton(stream.x):
            from tllm.kernels.triton.mmdit import adaln_modulate
            _, h = adaln_modulate(stream.x, shift, scale, 1e-6, split, (y, gate))
            return proj(h)
        from tllm.kernels.triton.ltx2_norms import per_token
        n = stream.x.shape[1]
        x = stream.x + y * per_token(gate, n, split)
        h = F.layer_norm(x, x.shape[-1:], eps=1e-6)
        return proj(h * (1 + per_token(scale, n, split)) + per_token(shift, n, split))

    # ---- checkpoints ----

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> LTX2Transformer:
        return transformer_from_folder(cls, LTX2Config, WeightLoader, path, dtype, device)

    def load_diffusers_state_dict(self, state_dict) -> None:
        load_named(WeightLoader(self), state_dict.items())


# diffusers' attention leaves -> (our module, slot): self-attention fuses q, k, v; cross k, v
_SELF = {"to_q": ("qkv", 0), "to_k": ("qkv", 1), "to_v": ("qkv", 2), "to_out.0": ("out", 0)}
_CROSS = {"to_q": ("q", 0), "to_k": ("kv", 0), "to_v": ("kv", 1), "to_out.0": ("out", 0)}
_SELF_ATTNS = ("attn1", "audio_attn1")
_RENAMES = {".emb.timestep_embedder.": ".", ".ff.net.0.proj.": ".ff.fc1.",
            ".ff.net.2.": ".ff.fc2.", ".audio_ff.net.0.proj.": ".audio_ff.fc1.",
            ".audio_ff.net.2.": ".audio_ff.fc2."}


def our_name(model: LTX2Transformer, name: str) -> tuple[str, slice | None]:
    """Our parameter (and its rows) for a diffusers-named weight."""
    dotted = f".{name}"
    for theirs, ours in _RENAMES.items():
        dotted = dotted.replace(theirs, ours)
    name = dotted[1:]
    parts = name.split(".")
    if parts[0] != "transformer_blocks" or len(parts) < 4:
        return name, None
    attn_name, rest = parts[2], ".".join(parts[3:])
    block = model.transformer_blocks[int(parts[1])]
    attn = getattr(block, attn_name, None)
    if not hasattr(attn, "norm_q"):
        return name, None
    prefix = ".".join(parts[:3])
    if rest in ("norm_q.weight", "norm_k.weight"):
        return f"{prefix}.{rest.split('.')[0]}", None
    module, leaf = rest.rsplit(".", 1)
    table = _SELF if attn_name in _SELF_ATTNS else _CROSS
    if module not in table:
        return name, None
    ours, slot = table[module]
    return f"{prefix}.{ours}.{leaf}", attn.slot_rows(ours, slot)


class WeightLoader:
    """Copies diffusers-named tensors into our (fused) parameters and checks at the end that
    every parameter was filled."""

    def __init__(self, model: LTX2Transformer) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        ours, rows = our_name(self.model, name)
        param = self.params.get(ours)
        if param is None:
            raise CheckpointError(f"weight {name!r} does not fit this config (no {ours})")
        target = param[rows] if rows is not None else param
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        self.filled[ours] = self.filled.get(ours, 0) + target.shape[0]

    def finish(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.shape[0]]
        if missing:
            raise CheckpointError(f"checkpoint lacks weights for {len(missing)} parameters, "
                                  f"e.g. {missing[:3]}")


@torch.no_grad()
def init_dummy_weights(model: LTX2Transformer, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks, generated on the model's device: QK norms at one,
    modulation tables small, the rest normal(0, std), output projections scaled down."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    out_std = std / math.sqrt(2 * model.config.num_layers)
    for name, param in model.named_parameters():
        if name.endswith(("norm_q", "norm_k")):
            param.fill_(1.0)
        elif name.endswith(("out.weight", "fc2.weight")):
            param.normal_(0.0, out_std, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)
