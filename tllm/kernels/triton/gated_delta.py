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
registers. Prefill is the reference's chunked form in two launches. The first gives every
chunk of every request its (I + A)^-1 (the unit lower-triangular system of the chunk's
corrections, by forward substitution a row at a time: as stable as the reference's
solve_triangular), all chunks at once since it does not depend on the state. The second walks
each request's chunks in order, and there a chunk is only matmuls: corrections, outputs and
the next state. Chunks of one request are not spread over programs (no state-passing split);
(request, head, tile) programs fill the GPU at serving batch sizes, fewer for one long
prompt."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, dot_precision, next_pow2


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
    """One token's q (normalised, scaled), k (normalised), v tile, g and beta."""
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
def _load_unit_rows(ptr, rows, valid, kk, mask_k, eps, stride):
    """A chunk's rows of q or k [C, Dk], each L2-normalised; zeros past the request's end."""
    x = tl.load(ptr + rows[:, None] * stride + kk[None, :],
                mask=valid[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 1) + eps)[:, None]


@triton.jit
def _chunk_keys(k_ptr, g_ptr, beta_ptr, rows, valid, head, qk_head, kk, mask_k, eps, K, s_k,
                s_g, s_beta):
    """A chunk's k [C, Dk] normalised, g and beta [C]. Rows past the request's end are
    zeros, so they neither decay nor write the state."""
    k = _load_unit_rows(k_ptr + qk_head * K, rows, valid, kk, mask_k, eps, s_k)
    g = tl.load(g_ptr + rows * s_g + head, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * s_beta + head, mask=valid, other=0.0).to(tl.float32)
    return k, g, beta


@triton.jit
def _decay(g, li):
    """The chunk's cumulative log decay c [C] and e^{c_i - c_j} for j <= i (0 above)."""
    c = tl.cumsum(g, 0)
    # masked before exp: above the diagonal the exponent is positive and may overflow
    return c, tl.exp(tl.where(li[:, None] >= li[None, :], c[:, None] - c[None, :],
                              float("-inf")))


@triton.jit
def _solve_unit_lower(a, rhs, li, CHUNK: tl.constexpr):
    """x with (I + a) x = rhs, `a` strictly lower triangular: forward substitution, a row at
    a time (as stable as the reference's triangular solve; powers of `a` are not)."""
    x = rhs
    for i in range(1, CHUNK):
        is_row = li[:, None] == i
        a_row = tl.sum(tl.where(is_row, a, 0.0), 0)                  # a[i, :], 0 for j >= i
        x_row = tl.sum(tl.where(is_row, x, 0.0), 0) - tl.sum(a_row[:, None] * x, 0)
        x = tl.where(is_row, x_row[None, :], x)
    return x


@triton.jit
def _chunk_inverse_kernel(cu_ptr, k_ptr, g_ptr, beta_ptr, inv_ptr, eps, K, s_k, s_g, s_beta,
                          HEADS_PER_QK: tl.constexpr, BLOCK_K: tl.constexpr,
                          CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 of one chunk of one request and head, A[i, j] = beta_i (k_i . k_j)
    e^{c_i - c_j} below the diagonal: it does not depend on the state, so every chunk's
    runs at once here, off the prefill kernel's chain from chunk to chunk."""
    req, pid_c, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first, end = tl.load(cu_ptr + req), tl.load(cu_ptr + req + 1)
    if first + pid_c * CHUNK >= end:
        return
    li = tl.arange(0, CHUNK)
    kk = tl.arange(0, BLOCK_K)
    rows = (first + pid_c * CHUNK + li).to(tl.int64)
    valid = rows < end
    k, g, beta = _chunk_keys(k_ptr, g_ptr, beta_ptr, rows, valid, head, head // HEADS_PER_QK,
                             kk, kk < K, eps, K, s_k, s_g, s_beta)
    _, decay = _decay(g, li)
    k_k = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    a = tl.where(li[:, None] > li[None, :], beta[:, None] * k_k * decay, 0.0)
    eye = tl.where(li[:, None] == li[None, :], 1.0, 0.0)
    inv = _solve_unit_lower(a, eye, li, CHUNK)
    row_stride = tl.num_programs(2) * CHUNK           # inv is [T, heads, CHUNK]
    tl.store(inv_ptr + rows[:, None] * row_stride + head * CHUNK + li[None, :], inv,
             mask=valid[:, None])


@triton.jit
def _chunk_update(state, q, k, v, g, beta, inv, li, PRECISION: tl.constexpr):
    """A chunk of C tokens on a [Dk, BLOCK_V] state tile (the reference's chunked form):
    the corrections u = (I + A)^-1 beta (v - e^c k S), then outputs and the next state."""
    c, decay = _decay(g, li)
    rhs = beta[:, None] * (v - tl.exp(c)[:, None] * tl.dot(k, state, input_precision=PRECISION))
    u = tl.dot(inv, rhs, input_precision=PRECISION)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
    out = tl.exp(c)[:, None] * tl.dot(q, state, input_precision=PRECISION)
    out += tl.dot(scores, u, input_precision=PRECISION)
    total = tl.sum(g, 0)                                                # padded rows add 0
    k_to_end = k * tl.exp(total - c)[:, None]
    state = state * tl.exp(total) + tl.dot(tl.trans(k_to_end), u, input_precision=PRECISION)
    return state, out


@triton.jit
def _prefill_kernel(state_ptr, slot_ptr, cu_ptr, inv_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                    out_ptr, scale, eps, K, V, s_state, s_q, s_k, s_v, s_g, s_beta, s_out,
                    HEADS_PER_QK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                    CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    req, head, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    first, end = tl.load(cu_ptr + req), tl.load(cu_ptr + req + 1)
    kk = tl.arange(0, BLOCK_K)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    li = tl.arange(0, CHUNK)
    mask_k, mask_v = kk < K, vv < V
    st_ptrs = state_ptr + slot * s_state + head * K * V + kk[:, None] * V + vv[None, :]
    st_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(st_ptrs, mask=st_mask, other=0.0).to(tl.float32)
    inv_ptr += head * CHUNK + li[None, :]
    for start in range(first, end, CHUNK):
        rows = (start + li).to(tl.int64)
        valid = rows < end
        k, g, beta = _chunk_keys(k_ptr, g_ptr, beta_ptr, rows, valid, head,
                                 head // HEADS_PER_QK, kk, mask_k, eps, K, s_k, s_g, s_beta)
        q = _load_unit_rows(q_ptr + (head // HEADS_PER_QK) * K, rows, valid, kk, mask_k, eps,
                            s_q) * scale
        v = tl.load(v_ptr + rows[:, None] * s_v + head * V + vv[None, :],
                    mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        inv = tl.load(inv_ptr + rows[:, None] * (tl.num_programs(1) * CHUNK),
                      mask=valid[:, None], other=0.0)
        state, out = _chunk_update(state, q, k, v, g, beta, inv, li, PRECISION)
        tl.store(out_ptr + rows[:, None] * s_out + head * V + vv[None, :], out,
                 mask=valid[:, None] & mask_v[None, :])
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


def _launch(kernel, grid_first: int, extra: tuple, tensors: tuple, scale: float, eps: float,
            min_block: int = 1, **meta) -> torch.Tensor:
    """One program per (request, value head, Dv tile); `min_block`: 16 where tl.dot runs."""
    state, q, k, v, g, beta = tensors
    _check_inputs(state, q, k, v, g, beta)
    num_heads, k_dim, v_dim = state.shape[1:]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if grid_first == 0 or v.shape[0] == 0:
        return out
    block_v = max(min_block, min(next_pow2(v_dim), 32))   # a 128 x 32 fp32 state tile
    kernel[(grid_first, num_heads, cdiv(v_dim, block_v))](
        state, *extra, q, k, v, g, beta, out, float(scale), float(eps), k_dim, v_dim,
        state.stride(0), q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        out.stride(0), HEADS_PER_QK=num_heads // q.shape[1],
        BLOCK_K=max(min_block, next_pow2(k_dim)), BLOCK_V=block_v, **meta)
    return out


def gated_delta_step(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, eps: float = 1e-6) -> torch.Tensor:
    """One decode step for S requests: state [slots_total, Hv, Dk, Dv] updated in place at
    rows `slots` [S]; q, k [S, Hk, Dk] raw (Hv a multiple of Hk); v [S, Hv, Dv]; g, beta
    [S, Hv]. Returns out [S, Hv, Dv] float32."""
    return _launch(_step_kernel, slots.numel(), (slots,), (state, q, k, v, g, beta), scale,
                   eps)


# C x Dk elements of the prefill's largest tiles: at C = 64, Dk = 128 the kernel asked for
# 238,848 bytes of shared memory on an H100 (limit 232,448), and at Dk = 128 C = 16 ran
# 1.7-2.1x faster than C = 32 (benchmarks/gpu_gated_delta.py, RESULTS.md 2026-12-06)
_MAX_CHUNK_TILE = 2048


def prefill_chunk(chunk_size: int, k_dim: int) -> int:
    """The chunk the prefill kernel runs: `chunk_size` as a power of two within [16, 64],
    smaller where its C x Dk tiles would not fit one SM's shared memory."""
    chunk = max(16, min(64, next_pow2(chunk_size)))
    while chunk > 16 and chunk * max(16, next_pow2(k_dim)) > _MAX_CHUNK_TILE:
        chunk //= 2
    return chunk


def gated_delta_prefill(state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, scale: float, eps: float = 1e-6,
                        chunk_size: int = 32, max_len: int | None = None) -> torch.Tensor:
    """A flattened batch: request i owns tokens cu_seqlens[i]:cu_seqlens[i+1] of q, k
    [T, Hk, Dk] (raw), v [T, Hv, Dv], g, beta [T, Hv], and starts from state[slots[i]]
    ([slots_total, Hv, Dk, Dv], updated in place to the state after its last token).
    Returns out [T, Hv, Dv] float32. `max_len`: the longest request (None: read from
    cu_seqlens, a device sync). The kernel's chunk is `prefill_chunk(chunk_size, Dk)`
    (the C x C and C x Dk tiles stay in registers); the result does not depend on it beyond
    rounding."""
    _check_inputs(state, q, k, v, g, beta)
    chunk, num_reqs, num_heads = prefill_chunk(chunk_size, k.shape[-1]), slots.numel(), v.shape[1]
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if num_reqs else 0
    # every chunk's (I + A)^-1, [T, Hv, C] float32: one scratch row of C per token and head
    inverses = torch.empty(v.shape[0], num_heads, chunk, dtype=torch.float32, device=v.device)
    precision = dot_precision(q.dtype)
    if num_reqs and max_len:
        _chunk_inverse_kernel[(num_reqs, cdiv(max_len, chunk), num_heads)](
            cu_seqlens, k, g, beta, inverses, float(eps), k.shape[-1], k.stride(0),
            g.stride(0), beta.stride(0), HEADS_PER_QK=num_heads // k.shape[1],
            BLOCK_K=max(16, next_pow2(k.shape[-1])), CHUNK=chunk, PRECISION=precision)
    return _launch(_prefill_kernel, num_reqs, (slots, cu_seqlens, inverses),
                   (state, q, k, v, g, beta), scale, eps, min_block=16, CHUNK=chunk,
                   PRECISION=precision,
                   num_warps=4 if chunk * next_pow2(k.shape[-1]) <= 2048 else 8)
