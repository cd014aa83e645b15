"""The gated delta rule (Gated DeltaNet, as Qwen3-Next's linear-attention layers use it) in
plain PyTorch: the chunked form for prefill and the single-step form for decode. Both work in
float32 on a state S [heads, k_dim, v_dim] per request; one token t does

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule: write the correction)
    o_t = S^T q_t

The inputs are those the layer prepares: q and k L2-normalised and already repeated to the
value heads, q scaled by k_dim^-0.5, g the log decay (<= 0), beta in (0, 1).

The chunked form: within a chunk of C tokens with cumulative log decay c_i, every token's
correction u_i = beta_i (v_i - e^{c_i} S0^T k_i - sum_{j<i} e^{c_i - c_j} (k_i . k_j) u_j)
depends on the earlier ones linearly, so the chunk's corrections are one unit lower-triangular
solve; outputs and the next state then follow from matmuls."""
from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as FLA does)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                            chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's T tokens from `state`: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H],
    state [H, Dk, Dv] (not modified). Returns (out [T, H, Dv] float32, new state float32)."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))      # [H, T, D]
    g, beta = g.float().t(), beta.float().t()                      # [H, T]
    s = state.float()
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk_size):
        part = slice(start, start + chunk_size)
        out[:, part], s = _one_chunk(q[:, part], k[:, part], v[:, part], g[:, part],
                                     beta[:, part], s)
    return out.transpose(0, 1), s


def _one_chunk(q, k, v, g, beta, s):
    """A chunk of C tokens, every head at once: q, k [H, C, Dk], v [H, C, Dv], g, beta
    [H, C], s [H, Dk, Dv]."""
    c = g.cumsum(-1)                                               # [H, C]
    size = c.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=c.device).tril()
    # e^{c_i - c_j} for j <= i; above the diagonal masked before exp (it could overflow)
    decay = (c[:, :, None] - c[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    lower = beta[..., None] * (k @ k.transpose(-1, -2)) * decay     # its diagonal is unused
    rhs = beta[..., None] * (v - c.exp()[..., None] * (k @ s))
    u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    out = c.exp()[..., None] * (q @ s) + ((q @ k.transpose(-1, -2)) * decay) @ u
    last = c[:, -1:]                                               # [H, 1]
    k_to_end = k * (last - c).exp()[..., None]
    new_state = last.exp()[..., None] * s + k_to_end.transpose(-1, -2) @ u
    return out, new_state


def gated_delta_step_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of S requests: q, k [S, H, Dk], v [S, H, Dv], g, beta [S, H];
    state [S, H, Dk, Dv] float32, updated in place. Returns out [S, H, Dv] float32."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("shkv,shk->shv", state, k)
    correction = beta[..., None] * (v - predicted)
    state.add_(k[..., :, None] * correction[..., None, :])
    return torch.einsum("shkv,shk->shv", state, q)
