"""The gated delta rule (Qwen3-Next's gated DeltaNet) in Triton: `gated_delta_step` advances a
batch of requests one token (decode) and `gated_delta_prefill` runs a flattened batch of
requests (varlen, each from its own state slot: chunked prefill composes). Both read and write
the recurrent state [slots, Hv, Dk, Dv] in place at each request's slot, so no gather or
scatter runs around them. References: gated_delta_ref.gated_delta_step_ref and
gated_delta_ref.gated_delta_chunked_ref.

q and k come in raw (after the conv), with the key heads' count (each serves consecutive value
heads): the kernels L2-normalise them and scale q by `scale`, as the reference's caller does
before it, so the layer never materialises the normalised, repeated float32 copies. g (the log
decay) and beta come in ready ([T, Hv] float32).

One program owns a (request, value head, Dv tile): the state tile [Dk, BLOCK_V] stays in
registers. The prefill kernel is, for now, the plain per-token recurrence over the request's
tokens (not the chunked WY form): exact, but its tokens run one after another, so long prompts
at small batch leave the GPU idle; the chunked form is the next step."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, next_pow2


@triton.jit
def _load_unit(ptr, offs, mask, eps):
    """A row of q or k, L2-normalised (eps inside the root, as the reference does)."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 0) + eps)


@triton.jit
def _delta_update(state, q, k, v, g, beta):
    """One token on a [Dk, BLOCK_V] state tile: decay, write the correction, read out."""
    state = state * tl.exp(g)
    predicted = tl.sum(state * k[:, None], 0)
    state += k[:, None] * (beta * (v - predicted))[None, :]
    return state, tl.sum(state * q[:, None], 0)


@triton.jit
def _token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, qk_head, kk, vv, mask_k,
                  mask_v, scale, eps, K, s_q, s_k, s_v, s_g, s_beta):
    q = _load_unit(q_ptr + row * s_q + qk_head * K, kk, mask_k, eps) * scale
    k = _load_unit(k_ptr + row * s_k + qk_head * K, kk, mask_k, eps)
    v = tl.load(v_ptr + row * s_v + vv, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * s_g + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * s_beta + head).to(tl.float32)
    return q, k, v, g, beta


@triton.jit
def _step_kernel(state_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, scale, eps,
                 K, V, s_state, s_q, s_k, s_v, s_g, s_beta, s_out,
                 HEADS_PER_QK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq, head, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = kk < K, vv < V
    st_ptrs = state_ptr + slot * s_state + head * K * V + kk[:, None] * V + vv[None, :]
    st_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(st_ptrs, mask=st_mask, other=0.0).to(tl.float32)
    q, k, v, g, beta = _token_inputs(q_ptr, k_ptr, v_ptr + head * V, g_ptr, beta_ptr,
                                     seq.to(tl.int64), head, head // HEADS_PER_QK, kk, vv,
                                     mask_k, mask_v, scale, eps, K, s_q, s_k, s_v, s_g, s_beta)
    state, out = _delta_update(state, q, k, v, g, beta)
    tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=st_mask)
    tl.store(out_ptr + seq * s_out + head * V + vv, out, mask=mask_v)


@triton.jit
def _prefill_kernel(state_ptr, slot_ptr, cu_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                    scale, eps, K, V, s_state, s_q, s_k, s_v, s_g, s_beta, s_out,
                    HEADS_PER_QK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    req, head, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    first = tl.load(cu_ptr + req).to(tl.int64)    # the loop's rows are int64 from here
    end = tl.load(cu_ptr + req + 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = kk < K, vv < V
    st_ptrs = state_ptr + slot * s_state + head * K * V + kk[:, None] * V + vv[None, :]
    st_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(st_ptrs, mask=st_mask, other=0.0).to(tl.float32)
    for row in range(first, end):
        q, k, v, g, beta = _token_inputs(q_ptr, k_ptr, v_ptr + head * V, g_ptr, beta_ptr, row,
                                         head, head // HEADS_PER_QK, kk, vv, mask_k, mask_v,
                                         scale, eps, K, s_q, s_k, s_v, s_g, s_beta)
        state, out = _delta_update(state, q, k, v, g, beta)
        tl.store(out_ptr + row * s_out + head * V + vv, out, mask=mask_v)
    tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=st_mask)


def _check_inputs(state, q, k, v, g, beta) -> None:
    num_heads, k_dim, v_dim = state.shape[1:]
    if state.stride(1) != k_dim * v_dim or state.stride(2) != v_dim or state.stride(3) != 1:
        raise ValueError("state must be contiguous within each slot")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name} must be contiguous within each token")
    for name, t in (("g", g), ("beta", beta)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if q.shape != k.shape or q.shape[-1] != k_dim or num_heads % q.shape[1]:
        raise ValueError(f"q, k {tuple(q.shape)} do not fit state {tuple(state.shape)}")
    if v.shape[1:] != (num_heads, v_dim):
        raise ValueError(f"v {tuple(v.shape)} does not fit state {tuple(state.shape)}")


def _launch(kernel, grid_first: int, extra: tuple, state, q, k, v, g, beta, scale: float,
            eps: float) -> torch.Tensor:
    _check_inputs(state, q, k, v, g, beta)
    num_heads, k_dim, v_dim = state.shape[1:]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if grid_first == 0 or v.shape[0] == 0:
        return out
    block_v = min(next_pow2(v_dim), 32)    # a 128 x 32 fp32 tile: 32 registers a thread
    kernel[(grid_first, num_heads, cdiv(v_dim, block_v))](
        state, *extra, q, k, v, g, beta, out, float(scale), float(eps), k_dim, v_dim,
        state.stride(0), q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        out.stride(0), HEADS_PER_QK=num_heads // q.shape[1], BLOCK_K=next_pow2(k_dim),
        BLOCK_V=block_v)
    return out


def gated_delta_step(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, eps: float = 1e-6) -> torch.Tensor:
    """One decode step for S requests: state [slots_total, Hv, Dk, Dv] updated in place at
    rows `slots` [S]; q, k [S, Hk, Dk] raw (Hv a multiple of Hk); v [S, Hv, Dv]; g, beta
    [S, Hv]. Returns out [S, Hv, Dv] float32."""
    return _launch(_step_kernel, slots.numel(), (slots,), state, q, k, v, g, beta, scale, eps)


def gated_delta_prefill(state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, scale: float, eps: float = 1e-6) -> torch.Tensor:
    """A flattened batch: request i owns tokens cu_seqlens[i]:cu_seqlens[i+1] of q, k
    [T, Hk, Dk] (raw), v [T, Hv, Dv], g, beta [T, Hv], and starts from state[slots[i]]
    ([slots_total, Hv, Dk, Dv], updated in place to the state after its last token).
    Returns out [T, Hv, Dv] float32."""
    return _launch(_prefill_kernel, slots.numel(), (slots, cu_seqlens), state, q, k, v, g,
                   beta, scale, eps)
