"""The two-stream (MMDiT) block of Qwen-Image and the ops it is built from.

Each stream (image, text) has its own AdaLN modulation, fused QKV projection, QK-RMSNorm,
output projection and GELU MLP; attention runs once over both streams together. The joint
sequence is [image, text]: key order does not change attention, and with text padded on the
right each row's valid keys are then a prefix, so padded rows need no mask (one SDPA call per
row on its prefix instead of a masked call that cannot use the flash kernels).

On CUDA the elementwise work runs in the fused Triton kernels of `tllm.kernels.triton.mmdit`
and attention prefers cuDNN's kernel; elsewhere the plain-PyTorch path below, written to
diffusers' numerics, runs instead."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tllm.visual_gen.models.qwen_image.rope import RopeTables

EPS = 1e-6


@dataclass(frozen=True)
class KeyPadding:
    """Which keys of the joint [image, text] sequence each row may attend to, built once per
    forward: nothing padded, a valid prefix per row (`prefix_lens`), or a general mask."""
    prefix_lens: tuple[int, ...] | None = None
    mask: torch.Tensor | None = None  # [B, 1, 1, S] bool

    @classmethod
    def from_text_mask(cls, text_mask: torch.Tensor | None, num_img_tokens: int,
                       device: torch.device) -> KeyPadding:
        if text_mask is None:
            return cls()
        valid = text_mask.to(device=device, dtype=torch.bool)
        batch, txt_len = valid.shape
        lens = valid.sum(1)
        is_prefix = torch.equal(valid, torch.arange(txt_len, device=valid.device) < lens[:, None])
        if is_prefix:
            lens = lens.tolist()
            if all(n == txt_len for n in lens):
                return cls()
            return cls(prefix_lens=tuple(num_img_tokens + n for n in lens))
        image = valid.new_ones(batch, num_img_tokens)
        return cls(mask=torch.cat([image, valid], dim=1)[:, None, None, :])


class QwenImageBlock(nn.Module):
    """One MMDiT block. `mod` holds both streams' AdaLN linears (image rows first); each
    stream's six modulation vectors are shift, scale, gate for attention, then for the MLP."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.mod = nn.Linear(dim, 12 * dim)
        self.img_qkv = nn.Linear(dim, 3 * dim)
        self.txt_qkv = nn.Linear(dim, 3 * dim)
        self.img_q_norm, self.img_k_norm, self.txt_q_norm, self.txt_k_norm = (
            nn.Parameter(torch.ones(head_dim)) for _ in range(4))
        self.img_out = nn.Linear(dim, dim)
        self.txt_out = nn.Linear(dim, dim)
        self.img_fc1, self.txt_fc1 = nn.Linear(dim, 4 * dim), nn.Linear(dim, 4 * dim)
        self.img_fc2, self.txt_fc2 = nn.Linear(4 * dim, dim), nn.Linear(4 * dim, dim)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, silu_temb: torch.Tensor,
                rope: RopeTables, padding: KeyPadding, split: int | None):
        """img [B, N, d], txt [B, L, d]; silu_temb [G * B, d] with G = 2 under zero_cond_t,
        where image tokens from `split` on take the second (zero-timestep) group."""
        batch = img.shape[0]
        mod = self.mod(silu_temb)
        img_mod = self._image_mods(mod, batch)
        txt_mod = mod[:batch, None, 6 * self.dim:].unflatten(-1, (6, self.dim)).unbind(2)

        img_h = modulated_norm(img, img_mod[0], img_mod[1], split)
        txt_h = modulated_norm(txt, txt_mod[0], txt_mod[1], None)
        img_attn, txt_attn = self._attention(img_h, txt_h, rope, padding)
        img, img_h = modulated_norm(img, img_mod[3], img_mod[4], split, (img_attn, img_mod[2]))
        txt, txt_h = modulated_norm(txt, txt_mod[3], txt_mod[4], None, (txt_attn, txt_mod[2]))
        img = gated_residual(img, self._mlp(img_h, self.img_fc1, self.img_fc2), img_mod[5], split)
        txt = gated_residual(txt, self._mlp(txt_h, self.txt_fc1, self.txt_fc2), txt_mod[5], None)
        return img, txt

    def modulated_input(self, img: torch.Tensor, silu_temb: torch.Tensor,
                        split: int | None) -> torch.Tensor:
        """The image stream's first modulated norm, as forward() takes it (TeaCache's
        signal)."""
        img_mod = self._image_mods(self.mod(silu_temb), img.shape[0])
        return modulated_norm(img, img_mod[0], img_mod[1], split)

    def _image_mods(self, mod: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
        img_mod = mod[:, :6 * self.dim].unflatten(0, (-1, batch)).transpose(0, 1)
        return img_mod.unflatten(-1, (6, self.dim)).unbind(2)     # 6 x [B, G, d]

    def _attention(self, img_h, txt_h, rope: RopeTables, padding: KeyPadding):
        batch, num_img = img_h.shape[:2]
        img_qkv = self.img_qkv(img_h)
        txt_qkv = self.txt_qkv(txt_h)
        seq = num_img + txt_h.shape[1]
        q, k, v = (img_h.new_empty(batch, seq, self.num_heads, self.head_dim) for _ in range(3))
        qk_norm_rope(img_qkv, self.img_q_norm, self.img_k_norm, rope.img_cos, rope.img_sin,
                     (q, k, v), 0)
        qk_norm_rope(txt_qkv, self.txt_q_norm, self.txt_k_norm, rope.txt_cos, rope.txt_sin,
                     (q, k, v), num_img)
        pieces = joint_attention(q, k, v, padding)
        return (project_rows(pieces, slice(0, num_img), self.img_out),
                project_rows(pieces, slice(num_img, None), self.txt_out))

    @staticmethod
    def _mlp(h: torch.Tensor, fc1: nn.Linear, fc2: nn.Linear) -> torch.Tensor:
        # GELU stays a pass of its own: torch's GEMM-epilogue GELU (_addmm_activation) is not
        # the tanh form that diffusers uses on every backend
        return fc2(F.gelu(fc1(h), approximate="tanh"))


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                   split: int | None,
                   residual: tuple[torch.Tensor, torch.Tensor] | None = None):
    """LayerNorm(x) * (1 + scale) + shift; with residual=(y, gate), first x = x + gate * y and
    returns (x, its modulated norm). shift, scale, gate: [B, G, d] (see QwenImageBlock)."""
    if x.is_cuda:
        from tllm.kernels.triton.mmdit import adaln_modulate
        return adaln_modulate(x, shift, scale, EPS, split, residual)
    if residual is not None:
        x = gated_residual(x, *residual, split)
    h = F.layer_norm(x, x.shape[-1:], eps=EPS)
    h = h * (1 + per_token(scale, x.shape[1], split)) + per_token(shift, x.shape[1], split)
    return h if residual is None else (x, h)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                   split: int | None) -> torch.Tensor:
    """x + gate * y in one pass (per token group when the gate has two groups)."""
    if gate.shape[1] == 1:
        return torch.addcmul(x, gate, y)
    out = torch.empty_like(x)
    for g, tokens in enumerate((slice(0, split), slice(split, None))):
        torch.addcmul(x[:, tokens], gate[:, g:g + 1], y[:, tokens], out=out[:, tokens])
    return out


def per_token(p: torch.Tensor, n_tokens: int, split: int | None) -> torch.Tensor:
    """[B, G, d] group parameters -> broadcastable over [B, n_tokens, d]."""
    if p.shape[1] == 1:
        return p
    index = (torch.arange(n_tokens, device=p.device) >= split).long()
    return p[:, index]


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], offset: int) -> None:
    """Writes one stream's RMSNorm+RoPE q, k and its v into the joint [B, S, H, D] buffers at
    sequence positions offset.. (see `tllm.kernels.triton.mmdit.qk_norm_rope`)."""
    if qkv.is_cuda:
        from tllm.kernels.triton import mmdit
        mmdit.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, EPS, out, offset)
        return
    q, k, v = qkv.unflatten(-1, (3, *out[0].shape[2:])).unbind(2)
    window = slice(offset, offset + qkv.shape[1])
    out[0][:, window] = _rms_rope(q, q_weight, cos, sin)
    out[1][:, window] = _rms_rope(k, k_weight, cos, sin)
    out[2][:, window] = v


def _rms_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm (float32 statistics, rounded before the weight), then the rotation of
    pairs (x[2i], x[2i+1]) in float32."""
    x = (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    padding: KeyPadding) -> list[torch.Tensor]:
    """Attention over the joint sequence; q, k, v are [B, S, H, D]. The result comes in pieces
    of [rows, S, H * D] that cover the batch in order (one piece per row when rows attend to
    different prefixes), so that nothing is copied to join them."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with _sdpa_backends(q.device):
        if padding.prefix_lens is None:
            pieces = [F.scaled_dot_product_attention(q, k, v, attn_mask=padding.mask)]
        else:
            pieces = [F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n],
                                                     v[b:b + 1, :, :n])
                      for b, n in enumerate(padding.prefix_lens)]
    return [piece.transpose(1, 2).flatten(2) for piece in pieces]


def _sdpa_backends(device: torch.device):
    """On CUDA prefer cuDNN's attention (faster than flash-2 on Hopper), then flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


def project_rows(pieces: list[torch.Tensor], tokens: slice, layer: nn.Linear) -> torch.Tensor:
    """`layer` on one stream's tokens of the attention output pieces -> [B, T, out]: one GEMM
    per batch row, each on a contiguous [T, H * D] slice, so the stream is never gathered."""
    rows = [row for piece in pieces for row in piece[:, tokens]]
    if not isinstance(layer, nn.Linear):    # an FP8 layer (visual_gen/fp8.py): its own GEMM
        return torch.stack([layer(row) for row in rows])
    out = rows[0].new_empty(len(rows), rows[0].shape[0], layer.weight.shape[0])
    for b, row in enumerate(rows):
        torch.addmm(layer.bias, row, layer.weight.t(), out=out[b])
    return out
