"""One Cosmos 3 mixture-of-transformers layer: pre-norm attention and MLP, with one set of
weights for the understanding (prompt) tokens and one for the generation tokens.

Understanding tokens attend causally among themselves; generation tokens attend to the whole
joint sequence of their branch. Each branch's keys and values are written straight into one
[und + gen] buffer by the QK-norm + RoPE step (no concatenation). Residual adds are deferred
into the next RMSNorm (one fused kernel on CUDA), as LLM decoders do. On CUDA the QK-norm +
RoPE step is the Triton kernel of `tllm.kernels.triton.gqa_norm_rope`, attention prefers
cuDNN's kernel; elsewhere plain PyTorch written to diffusers' numerics."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tllm.layers.norm import RMSNorm


class MoTLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_q, self.num_kv, self.head_dim = (config.num_attention_heads,
                                                  config.num_key_value_heads, hd)
        self.eps = config.rms_norm_eps
        self.is_relu2 = config.hidden_act == "relu2"
        qkv_rows = (self.num_q + 2 * self.num_kv) * hd
        bias = config.attention_bias
        self.und_qkv, self.gen_qkv = nn.Linear(d, qkv_rows, bias), nn.Linear(d, qkv_rows, bias)
        self.und_out = nn.Linear(self.num_q * hd, d, bias)
        self.gen_out = nn.Linear(self.num_q * hd, d, bias)
        self.und_q_norm = self.und_k_norm = self.und_k_norm_for_gen = None
        if config.qk_norm_for_text:
            self.und_q_norm, self.und_k_norm = (nn.Parameter(torch.ones(hd)) for _ in range(2))
        elif config.use_und_k_norm_for_gen:
            self.und_k_norm_for_gen = nn.Parameter(torch.ones(hd))
        self.gen_q_norm, self.gen_k_norm = (nn.Parameter(torch.ones(hd)) for _ in range(2))
        inter = config.intermediate_size
        up_rows = inter if self.is_relu2 else 2 * inter
        self.und_gate_up, self.gen_gate_up = (nn.Linear(d, up_rows, bias=False)
                                              for _ in range(2))
        self.und_down, self.gen_down = (nn.Linear(inter, d, bias=False) for _ in range(2))
        self.input_layernorm = RMSNorm(d, self.eps)
        self.input_layernorm_moe_gen = RMSNorm(d, self.eps)
        self.post_attention_layernorm = RMSNorm(d, self.eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(d, self.eps)

    def slot_rows(self, module: str, slot: int) -> slice | None:
        """The rows of fused parameter `module` that diffusers' slot-th projection fills."""
        hd = self.head_dim
        if module.endswith("_qkv"):
            sizes = [self.num_q * hd, self.num_kv * hd, self.num_kv * hd]
            start = sum(sizes[:slot])
            return slice(start, start + sizes[slot])
        if module.endswith("_gate_up") and not self.is_relu2:
            inter = self.und_down.weight.shape[1]
            return slice(slot * inter, (slot + 1) * inter)
        if module.endswith("_gate_up") and slot == 0:
            raise ValueError("a relu2 MLP has no gate projection")
        return None

    def forward(self, und, und_res, gen, gen_res, layouts):
        """und [sum of und_len, d], gen [branches * N, d], each with its pending residual
        (None in the first layer); returns them for the next layer, residual still pending."""
        und_h, und_res = _norm(self.input_layernorm, und, und_res)
        gen_h, gen_res = _norm(self.input_layernorm_moe_gen, gen, gen_res)
        und_attn, gen_attn = self._attention(self.und_qkv(und_h), self.gen_qkv(gen_h), layouts)
        und_h, und_res = self.post_attention_layernorm(self.und_out(und_attn), und_res)
        gen_h, gen_res = self.post_attention_layernorm_moe_gen(self.gen_out(gen_attn), gen_res)
        return (self._mlp(und_h, self.und_gate_up, self.und_down), und_res,
                self._mlp(gen_h, self.gen_gate_up, self.gen_down), gen_res)

    def _attention(self, und_qkv, gen_qkv, layouts):
        num_gen = gen_qkv.shape[0] // len(layouts)
        shape = (self.num_kv, self.head_dim)
        q_und = und_qkv.new_empty(und_qkv.shape[0], self.num_q, self.head_dim)
        q_gen = gen_qkv.new_empty(gen_qkv.shape[0], self.num_q, self.head_dim)
        und_out, gen_out, start = [], [], 0
        for b, layout in enumerate(layouts):
            n = layout.und_len
            und_rows, gen_rows = slice(start, start + n), slice(b * num_gen, (b + 1) * num_gen)
            keys, values = (und_qkv.new_empty(n + num_gen, *shape) for _ in range(2))
            gen_keys = keys
            norm_rope(und_qkv[und_rows], self.und_q_norm, self.und_k_norm, layout.cos[:n],
                      layout.sin[:n], self.eps, q_und[und_rows], keys[:n], values[:n])
            if self.und_k_norm_for_gen is not None:   # gen queries see other und keys
                gen_keys = und_qkv.new_empty(n + num_gen, *shape)
                norm_rope(und_qkv[und_rows], None, self.und_k_norm_for_gen, layout.cos[:n],
                          layout.sin[:n], self.eps, None, gen_keys[:n], None)
            norm_rope(gen_qkv[gen_rows], self.gen_q_norm, self.gen_k_norm, layout.cos[n:],
                      layout.sin[n:], self.eps, q_gen[gen_rows], gen_keys[n:], values[n:])
            und_out.append(_sdpa(q_und[und_rows], keys[:n], values[:n], causal=True))
            gen_out.append(_sdpa(q_gen[gen_rows], gen_keys, values, causal=False))
            start += n
        return torch.cat(und_out), torch.cat(gen_out)

    def _mlp(self, h, gate_up: nn.Linear, down: nn.Linear):
        up = gate_up(h)
        if self.is_relu2:
            return down(torch.relu(up).square())
        if up.is_cuda:
            from tllm.kernels.triton.activation import silu_and_mul
            return down(silu_and_mul(up))
        gate, up = up.chunk(2, dim=-1)
        return down(F.silu(gate) * up)


def _norm(norm: RMSNorm, x, residual):
    """The layer's input norm: of x alone in the first layer, else of x + residual."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def norm_rope(qkv, q_weight, k_weight, cos, sin, eps, q_out, k_out, v_out) -> None:
    """RMSNorm (a None weight: none) and rotate-half RoPE of q and k, written with v into the
    buffers given; with q_out None, only k."""
    if qkv.is_cuda:
        from tllm.kernels.triton.gqa_norm_rope import gqa_norm_rope
        gqa_norm_rope(qkv, q_weight, k_weight, cos, sin, eps, q_out, k_out, v_out)
        return
    num_kv, head_dim = k_out.shape[1:]
    num_q = qkv.shape[1] // head_dim - 2 * num_kv
    q, k, v = qkv.unflatten(-1, (-1, head_dim)).split([num_q, num_kv, num_kv], dim=1)
    k_out.copy_(_rms_rope(k, k_weight, cos, sin, eps))
    if q_out is not None:
        q_out.copy_(_rms_rope(q, q_weight, cos, sin, eps))
        v_out.copy_(v)


def _rms_rope(x, weight, cos, sin, eps):
    """diffusers' RMSNorm (float32 statistics, rounded before the weight), then x * cos +
    rotate_half(x) * sin in x's dtype, with cos/sin rounded to it as diffusers rounds them."""
    if weight is not None:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = (x * torch.rsqrt(variance + eps)).to(x.dtype) * weight
    cos = torch.cat([cos, cos], -1)[:, None].to(x.dtype)
    sin = torch.cat([sin, sin], -1)[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _sdpa(q, k, v, causal: bool) -> torch.Tensor:
    """[S, H, D] queries over [S', Hk, D] keys -> [S, H * D]."""
    if q.is_cuda and k.shape[1] != q.shape[1]:
        # whole heads for the fused kernels (cuDNN's and flash's GQA support varies by
        # version; the math fallback would not fit a video's attention matrix)
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    with _sdpa_backends(q.device):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1).flatten(1)


def _sdpa_backends(device: torch.device):
    """On CUDA prefer cuDNN's attention (faster than flash-2 on Hopper), then flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION], set_priority=True)
