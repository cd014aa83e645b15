"""One LTX-2 block: a video stream and an audio stream, each with self-attention, attention to
its prompt and a GELU MLP (AdaLN-modulated RMSNorms, gated residuals), joined by audio-to-video
and video-to-audio cross attention (both read the norms taken before either stream updates).

Residual adds are folded into the next norm (`rms_modulate`), and the last MLP's gated
residual is handed to the next block's first norm. The prompt's keys and values do not
change between steps: `text_kv` computes them once per generation. On CUDA the norms and
QK-norm + RoPE are the Triton kernels of `tllm.kernels.triton.ltx2_norms` and attention
prefers cuDNN's kernel; elsewhere their torch references, written to diffusers' numerics."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tllm.kernels.triton.ltx2_norms import norm_rope_ref, rms_modulate_ref
from tllm.visual_gen.models.ltx2.rope import RopeTable


@dataclass
class StreamMods:
    """One stream's modulation for a block, each [B, G, d]: the block's six (shift, scale,
    gate for self-attention, then for the MLP), and the cross attention's four (scale, shift
    as query... see LTX2Block.forward) and gate."""
    main: tuple[torch.Tensor, ...]
    cross: tuple[torch.Tensor, ...]
    cross_gate: torch.Tensor


@dataclass
class StreamState:
    """A stream between blocks: hidden states and the pending gated residual (y, gate)."""
    x: torch.Tensor
    pending: tuple[torch.Tensor, torch.Tensor] | None = None


class Attention(nn.Module):
    """LTX-2 attention: q, k, v projections (fused to qkv for self-attention, kv for cross),
    RMSNorm of q and k across heads, RoPE (optional), SDPA, output projection."""

    def __init__(self, query_dim: int, kv_dim: int | None, heads: int, head_dim: int,
                 bias: bool, out_bias: bool, eps: float) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.eps, self.is_self = heads, eps, kv_dim is None
        if self.is_self:
            self.qkv = nn.Linear(query_dim, 3 * inner, bias=bias)
        else:
            self.q = nn.Linear(query_dim, inner, bias=bias)
            self.kv = nn.Linear(kv_dim, 2 * inner, bias=bias)
        self.norm_q = nn.Parameter(torch.ones(inner))
        self.norm_k = nn.Parameter(torch.ones(inner))
        self.out = nn.Linear(inner, query_dim, bias=out_bias)

    def slot_rows(self, name: str, slot: int) -> slice | None:
        inner = self.norm_q.shape[0]
        if name in ("qkv", "kv"):
            return slice(slot * inner, (slot + 1) * inner)
        return None

    def self_attention(self, h: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        qkv = self.qkv(h)
        q, k, v = qkv.chunk(3, dim=-1)
        return self._attend(self._norm(q, self.norm_q, rope), self._norm(k, self.norm_k, rope),
                            v, None)

    def keys_values(self, context: torch.Tensor, rope: RopeTable | None = None):
        """(k, v) of a key/value sequence: normed (and rotated) k, v as projected."""
        k, v = self.kv(context).chunk(2, dim=-1)
        return self._norm(k, self.norm_k, rope), v

    def cross_attention(self, h: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                        mask: torch.Tensor | None, rope: RopeTable | None = None):
        q = self._norm(self.q(h), self.norm_q, rope)
        return self._attend(q, *kv, mask)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, rope: RopeTable | None):
        tables = () if rope is None else (rope.cos, rope.sin, rope.split_chunks)
        if uses_triton(x):
            from tllm.kernels.triton.ltx2_norms import norm_rope
            return norm_rope(x, weight, self.eps, *tables)
        return norm_rope_ref(x, weight, self.eps, *tables)

    def _attend(self, q, k, v, mask):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        with sdpa_backends(q.device):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim, bias=bias)
        self.fc2 = nn.Linear(4 * dim, dim, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class LTX2Block(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        c = config
        d, ad = c.inner_dim, c.audio_inner_dim
        bias, out_bias, eps = c.attention_bias, c.attention_out_bias, c.norm_eps
        vh, vhd = c.num_attention_heads, c.attention_head_dim
        ah, ahd = c.audio_num_attention_heads, c.audio_attention_head_dim
        self.eps = eps
        self.attn1 = Attention(d, None, vh, vhd, bias, out_bias, eps)
        self.audio_attn1 = Attention(ad, None, ah, ahd, bias, out_bias, eps)
        self.attn2 = Attention(d, c.cross_attention_dim, vh, vhd, bias, out_bias, eps)
        self.audio_attn2 = Attention(ad, c.audio_cross_attention_dim, ah, ahd, bias, out_bias,
                                     eps)
        self.audio_to_video_attn = Attention(d, ad, ah, ahd, bias, out_bias, eps)
        self.video_to_audio_attn = Attention(ad, d, ah, ahd, bias, out_bias, eps)
        self.ff = FeedForward(d, c.ff_bias)
        self.audio_ff = FeedForward(ad, c.audio_ff_bias)
        self.scale_shift_table = nn.Parameter(torch.zeros(6, d))
        self.audio_scale_shift_table = nn.Parameter(torch.zeros(6, ad))
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.zeros(5, d))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.zeros(5, ad))

    def text_kv(self, video_text: torch.Tensor, audio_text: torch.Tensor):
        """The prompt's (k, v) for the video and the audio stream's attention to it."""
        return self.attn2.keys_values(video_text), self.audio_attn2.keys_values(audio_text)

    def modulations(self, temb, temb_audio, temb_cross, temb_cross_audio, gate_cross,
                    gate_cross_audio) -> tuple[StreamMods, StreamMods]:
        """This block's tables plus the timestep embeddings ([B, G, k * d] each)."""
        def mods(table, temb):
            return (table + temb.unflatten(-1, (table.shape[0], -1))).unbind(2)

        video_table, audio_table = (self.video_a2v_cross_attn_scale_shift_table,
                                    self.audio_a2v_cross_attn_scale_shift_table)
        return (StreamMods(mods(self.scale_shift_table, temb), mods(video_table[:4], temb_cross),
                           mods(video_table[4:], gate_cross)[0]),
                StreamMods(mods(self.audio_scale_shift_table, temb_audio),
                           mods(audio_table[:4], temb_cross_audio),
                           mods(audio_table[4:], gate_cross_audio)[0]))

    def forward(self, video: StreamState, audio: StreamState, vmod: StreamMods,
                amod: StreamMods, text_kv, text_masks, rope, split, cross_rows):
        """Advances both streams by this block; `cross_rows` [B, 1, 1] (or None) is 0 for the
        batch rows that run with the two streams isolated (no cross attention)."""
        (v_text_kv, a_text_kv), (v_mask, a_mask) = text_kv, text_masks
        vx, vh = self._self_and_text(video, vmod, self.attn1, self.attn2, v_text_kv, v_mask,
                                     rope.video, split)
        ax, ah = self._self_and_text(audio, amod, self.audio_attn1, self.audio_attn2, a_text_kv,
                                     a_mask, rope.audio, None)
        # the cross tables' order: scale, shift of the a2v attention, then of the v2a one
        va_scale, va_shift, vv_scale, vv_shift = vmod.cross
        aa_scale, aa_shift, av_scale, av_shift = amod.cross
        vx, (v_as_query, v_as_kv) = modulate(vx, [(va_shift, va_scale), (vv_shift, vv_scale)],
                                             self.eps, split, (vh, None))
        ax, (a_as_kv, a_as_query) = modulate(ax, [(aa_shift, aa_scale), (av_shift, av_scale)],
                                             self.eps, None, (ah, None))
        a2v = self.audio_to_video_attn.cross_attention(
            v_as_query, self.audio_to_video_attn.keys_values(a_as_kv, rope.audio_cross), None,
            rope.video_cross)
        v2a = self.video_to_audio_attn.cross_attention(
            a_as_query, self.video_to_audio_attn.keys_values(v_as_kv, rope.video_cross), None,
            rope.audio_cross)
        v_gate, a_gate = vmod.cross_gate, amod.cross_gate
        if cross_rows is not None:
            v_gate, a_gate = v_gate * cross_rows, a_gate * cross_rows
        video = self._mlp(vx, (a2v, v_gate), vmod.main, self.ff, split)
        audio = self._mlp(ax, (v2a, a_gate), amod.main, self.audio_ff, None)
        return video, audio

    def _self_and_text(self, stream: StreamState, mods: StreamMods, attn1: Attention,
                       attn2: Attention, text_kv, text_mask, rope: RopeTable, split):
        shift, scale, gate = mods.main[:3]
        x, (h,) = modulate(stream.x, [(shift, scale)], self.eps, split, stream.pending)
        x, (h,) = modulate(x, [], self.eps, split, (attn1.self_attention(h, rope), gate))
        return x, attn2.cross_attention(h, text_kv, text_mask)

    def _mlp(self, x, residual, main_mods, ff: FeedForward, split) -> StreamState:
        shift, scale, gate = main_mods[3:]
        x, (h,) = modulate(x, [(shift, scale)], self.eps, split, residual)
        return StreamState(x, (ff(h), gate))


def modulate(x, mods, eps, split, residual=None):
    """`rms_modulate`: the Triton kernel on CUDA, its reference elsewhere; with a residual
    whose pending value is None, only the norm."""
    if residual is not None and residual[0] is None:
        residual = None
    if uses_triton(x):
        from tllm.kernels.triton.ltx2_norms import rms_modulate
        out = rms_modulate(x, mods, eps, split, residual)
    else:
        out = rms_modulate_ref(x, mods, eps, split, residual)
    return out if residual is not None else (x, out)


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the elementwise work runs in the Triton kernels (CUDA tensors; tests also
    run them on the CPU under the Triton interpreter)."""
    return x.is_cuda


def sdpa_backends(device: torch.device):
    """On CUDA prefer cuDNN's attention (faster than flash-2 on Hopper), then flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)
