"""Mamba-2's causal depthwise conv1d + SiLU over a flattened batch of requests (varlen), each
continuing from the conv state at its slot (the K-1 inputs before its first token), which is
then advanced in place. One request of one token is a decode step: the same kernels serve
prefill chunks and decode. References: mamba_ref.causal_conv1d_ref (one request) and
mamba_ref.causal_conv1d_step_ref (a decode batch).

Two launches: the outputs (each tile of tokens x channels reads its K taps from x or, before
the request's first token, from the old state), then the new states (read whole before they
are written, so no program reads a state another has already advanced)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, next_pow2


@triton.jit
def _conv_out_kernel(out_ptr, x_ptr, state_ptr, slot_ptr, cu_ptr, w_ptr, bias_ptr, D,
                     s_x, s_out, s_state, s_state_d, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    req, pid_t, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first, end = tl.load(cu_ptr + req), tl.load(cu_ptr + req + 1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)            # positions within the request
    if pid_t * BLOCK_T >= end - first:
        return
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t, mask_d = t < end - first, d < D
    slot = tl.load(slot_ptr + req).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        src = t - (K - 1) + k                               # < 0: in the old state
        from_x = mask_t[:, None] & mask_d[None, :] & (src >= 0)[:, None]
        from_state = mask_t[:, None] & mask_d[None, :] & (src < 0)[:, None]
        xv = tl.load(x_ptr + (first + src).to(tl.int64)[:, None] * s_x + d[None, :],
                     mask=from_x, other=0.0).to(tl.float32)
        sv = tl.load(state_ptr + slot * s_state + d[None, :] * s_state_d
                     + (K - 1 + src)[:, None], mask=from_state, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d * K + k, mask=mask_d, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (first + t).to(tl.int64)[:, None] * s_out + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slot_ptr, cu_ptr, D, s_x, s_state, s_state_d,
                       K: tl.constexpr, KPAD: tl.constexpr, BLOCK_D: tl.constexpr):
    req, pid_d = tl.program_id(0), tl.program_id(1)
    first, end = tl.load(cu_ptr + req), tl.load(cu_ptr + req + 1)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, KPAD)                                  # new state column
    slot = tl.load(slot_ptr + req).to(tl.int64)
    src = (end - first) - (K - 1) + j                       # < 0: an old state column
    valid = (d < D)[:, None] & (j < K - 1)[None, :]
    ptrs = state_ptr + slot * s_state + d[:, None] * s_state_d
    old = tl.load(ptrs + (K - 1 + src)[None, :], mask=valid & (src < 0)[None, :], other=0.0)
    new = tl.load(x_ptr + (first + src).to(tl.int64)[None, :] * s_x + d[:, None],
                  mask=valid & (src >= 0)[None, :], other=0.0)
    tl.store(ptrs + j[None, :], (old + new).to(state_ptr.dtype.element_ty), mask=valid)


def causal_conv1d_varlen(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         cu_seqlens: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, max_len: int) -> torch.Tensor:
    """x [T, D] (request i owns rows cu_seqlens[i]:cu_seqlens[i+1], at most `max_len`);
    conv_state [slots_total, D, K-1] advanced in place at `slots`; weight [D, K]. Returns
    silu(conv) [T, D] in x's dtype."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or conv_state.stride(-1) != 1:
        raise ValueError("x, weight and conv_state must be contiguous in their last dim")
    num_reqs, D, K = slots.numel(), x.shape[1], weight.shape[1]
    out = torch.empty_like(x)
    if num_reqs == 0:
        return out
    block_t, block_d = min(16, next_pow2(max_len)), min(128, next_pow2(D))
    _conv_out_kernel[(num_reqs, cdiv(max_len, block_t), cdiv(D, block_d))](
        out, x, conv_state, slots, cu_seqlens, weight, bias if bias is not None else weight,
        D, x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), K=K,
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_D=block_d)
    _conv_state_kernel[(num_reqs, cdiv(D, block_d))](
        x, conv_state, slots, cu_seqlens, D, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), K=K, KPAD=next_pow2(max(K - 1, 1)), BLOCK_D=block_d)
    return out
