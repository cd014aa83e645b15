"""Mamba-2's SSD scan in Triton: `ssd_state_update` advances a batch of requests one token
(decode) and `ssd_chunk_scan` prefills a flattened batch of requests (varlen, each from its
own state slot: chunked prefill composes). Both read dt before bias and softplus, and read and
write the state in place at each request's slot, so no gather or scatter runs around them.
References: mamba_ref.ssd_state_update_ref and mamba_ref.ssd_chunk_scan_ref.

The prefill kernel gives one program to a (request, head, head-dim block) and walks that
request's chunks in order, the state kept in registers: within a chunk the output is two
matmuls (the masked C.B^T scores against x, and C against the carried state), and the state
moves on by one more. Chunks of one request are not spread over programs (the state-passing
split of the paper's kernel); enough (request, head) programs fill the GPU at serving batch
sizes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, dot_precision, next_pow2


@triton.jit
def _discretize(dt, dt_bias, lo, hi):
    """softplus(dt + bias) (torch's threshold of 20), clamped to [lo, hi]."""
    v = dt + dt_bias
    v = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))
    return tl.minimum(tl.maximum(v, lo), hi)


@triton.jit
def _state_update_kernel(state_ptr, slot_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr,
                         d_ptr, y_ptr, dt_lo, dt_hi, P, N,
                         s_state, s_x, s_dt, s_b, s_c, s_y,
                         HEADS_PER_GROUP: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    seq, head, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = head // HEADS_PER_GROUP
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = p < P, n < N
    mask = mask_p[:, None] & mask_n[None, :]
    st_ptrs = state_ptr + slot * s_state + head * P * N + p[:, None] * N + n[None, :]
    state = tl.load(st_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + seq * s_x + head * P + p, mask=mask_p, other=0.0).to(tl.float32)
    dt = _discretize(tl.load(dt_ptr + seq * s_dt + head).to(tl.float32),
                     tl.load(dt_bias_ptr + head).to(tl.float32), dt_lo, dt_hi)
    a = tl.load(a_ptr + head).to(tl.float32)
    b = tl.load(b_ptr + seq * s_b + group * N + n, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + seq * s_c + group * N + n, mask=mask_n, other=0.0).to(tl.float32)
    state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
    tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * c[None, :], 1) + tl.load(d_ptr + head).to(tl.float32) * x
    tl.store(y_ptr + seq * s_y + head * P + p, y, mask=mask_p)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")


def ssd_state_update(state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                     dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor,
                     dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """One decode step: state [slots_total, H, P, N] (contiguous per slot) updated in place at
    rows `slots` [S]; x [S, H, P]; dt [S, H] (raw); B, C [S, G, N]. Returns y [S, H, P] fp32."""
    num_seqs, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    x, B, C = x.flatten(1), B.flatten(1), C.flatten(1)
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        _check_rows(name, t)
    y = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=x.device)
    block_p = min(next_pow2(head_dim), 32)
    grid = (num_seqs, num_heads, cdiv(head_dim, block_p))
    _state_update_kernel[grid](
        state, slots, x, dt, dt_bias, A, B, C, D, y, float(dt_limit[0]), float(dt_limit[1]),
        head_dim, state_size, state.stride(0), x.stride(0), dt.stride(0), B.stride(0),
        C.stride(0), num_heads * head_dim, HEADS_PER_GROUP=num_heads // num_groups,
        BLOCK_P=block_p, BLOCK_N=next_pow2(state_size))
    return y


@triton.jit
def _chunk_scan_kernel(state_ptr, slot_ptr, cu_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr,
                       c_ptr, d_ptr, y_ptr, dt_lo, dt_hi, P, N,
                       s_state, s_x, s_dt, s_b, s_c, s_y,
                       HEADS_PER_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    req, head, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = head // HEADS_PER_GROUP
    slot = tl.load(slot_ptr + req).to(tl.int64)
    first, end = tl.load(cu_ptr + req), tl.load(cu_ptr + req + 1)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    li = tl.arange(0, CHUNK)
    mask_p, mask_n = p < P, n < N
    st_ptrs = state_ptr + slot * s_state + head * P * N + p[:, None] * N + n[None, :]
    st_mask = mask_p[:, None] & mask_n[None, :]
    state = tl.load(st_ptrs, mask=st_mask, other=0.0).to(tl.float32)       # [P, N]
    a = tl.load(a_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)
    causal = li[:, None] >= li[None, :]
    for start in range(first, end, CHUNK):
        rows = (start + li).to(tl.int64)
        valid = rows < end
        x = tl.load(x_ptr + rows[:, None] * s_x + head * P + p[None, :],
                    mask=valid[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
        dt = _discretize(tl.load(dt_ptr + rows * s_dt + head, mask=valid, other=0.0).to(
            tl.float32), dt_bias, dt_lo, dt_hi)
        dt = tl.where(valid, dt, 0.0)          # padded rows neither decay nor add
        b = tl.load(b_ptr + rows[:, None] * s_b + group * N + n[None, :],
                    mask=valid[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        c = tl.load(c_ptr + rows[:, None] * s_c + group * N + n[None, :],
                    mask=valid[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        log_decay = tl.cumsum(dt * a, 0)                                    # [L]
        total = tl.sum(dt * a, 0)
        # masked before exp: above the diagonal the exponent is positive and may overflow
        seg = tl.where(causal, log_decay[:, None] - log_decay[None, :], float("-inf"))
        scores = tl.dot(c, tl.trans(b), input_precision=PRECISION) * tl.exp(seg)
        y = tl.dot(scores * dt[None, :], x, input_precision=PRECISION)      # [L, P]
        y += tl.dot(c, tl.trans(state), input_precision=PRECISION) * tl.exp(log_decay)[:, None]
        y += d * x
        tl.store(y_ptr + rows[:, None] * s_y + head * P + p[None, :], y,
                 mask=valid[:, None] & mask_p[None, :])
        weight = dt * tl.exp(total - log_decay)                             # s -> chunk end
        state = state * tl.exp(total) + tl.dot(tl.trans(x * weight[:, None]), b,
                                                input_precision=PRECISION)
    tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=st_mask)


def ssd_chunk_scan(state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                   x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, chunk_size: int,
                   dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """Prefill of a flattened batch: request i owns tokens cu_seqlens[i]:cu_seqlens[i+1] of
    x [T, H, P], dt [T, H] (raw), B, C [T, G, N], and starts from state[slots[i]]
    ([slots_total, H, P, N], updated in place to the state after its last token). Returns
    y [T, H, P] fp32 with the D skip. The kernel's tile is `chunk_size` within [16, 64]
    (the L x L scores stay in registers): free to differ from the model's chunk size, as the
    result is the same up to rounding."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    x, B, C = x.flatten(1), B.flatten(1), C.flatten(1)
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        _check_rows(name, t)
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    block_p = max(16, min(next_pow2(head_dim), 64))
    grid = (slots.numel(), num_heads, cdiv(head_dim, block_p))
    _chunk_scan_kernel[grid](
        state, slots, cu_seqlens, x, dt, dt_bias, A, B, C, D, y, float(dt_limit[0]),
        float(dt_limit[1]), head_dim, state_size, state.stride(0), x.stride(0), dt.stride(0),
        B.stride(0), C.stride(0), num_heads * head_dim,
        HEADS_PER_GROUP=num_heads // num_groups, CHUNK=max(16, min(64, next_pow2(chunk_size))),
        BLOCK_P=block_p, BLOCK_N=max(16, next_pow2(state_size)),
        PRECISION=dot_precision(x.dtype))
    return y
