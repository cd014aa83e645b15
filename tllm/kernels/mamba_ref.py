"""Torch references of the Mamba-2 mixer's pieces (the SSD scan of state space duality, its
causal depthwise conv1d, the grouped gated RMSNorm), written for one request's state at a time
so a prompt can be prefilled in several chunks: every prefill function takes the state the
previous chunk left and returns the new one; every `*_step` advances a batch one token.

Shapes (one request): x [T, H, P] (heads, head dim), dt [T, H] before bias and softplus,
A [H] (negative, -exp(A_log)), B and C [T, G, N] (groups, state size; H is a multiple of G),
ssm state [H, P, N]; conv input [T, D] with conv state [D, K-1] (the last K-1 inputs).
The CPU path runs these; the Triton kernels in kernels/triton/mamba_ssd.py are checked
against them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """softplus(dt + bias), clamped to the model's limits; float32."""
    dt = F.softplus(dt.float() + dt_bias.float())
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group serves H/G consecutive heads."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_chunk_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                       chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's prefill: y [T, H, P] (float32, with the D skip) and the state after its
    last token. `dt` is already discretized. Within a chunk the output is an attention-like
    masked product (C_l . B_s times the decay from s to l); across chunks only the state
    travels, so the chunks and the caller's prompt chunks compose exactly."""
    num_heads = x.shape[1]
    x, B, C, A = x.float(), _heads(B, num_heads), _heads(C, num_heads), A.float()
    state = state.float()
    outputs = []
    for start in range(0, x.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        y, state = _scan_one_chunk(x[part], dt[part], A, B[part], C[part], state)
        outputs.append(y)
    y = torch.cat(outputs) if outputs else x.new_zeros(x.shape)
    return y + D.float()[:, None] * x, state


def _scan_one_chunk(x, dt, A, B, C, state):
    length = x.shape[0]
    log_decay = torch.cumsum(dt * A, dim=0)                       # [L, H]: log prod of decays
    # decay from position s to l (s <= l): exp(cum_l - cum_s); masked before exp (overflow)
    diff = log_decay[:, None, :] - log_decay[None, :, :]          # [l, s, H]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    scores = torch.einsum("lhn,shn->lsh", C, B) * decay
    x_dt = x * dt[..., None]                                      # [L, H, P]
    y = torch.einsum("lsh,shp->lhp", scores, x_dt)
    y = y + torch.einsum("lhn,hpn->lhp", C, state) * log_decay.exp()[..., None]
    to_end = (log_decay[-1:] - log_decay).exp()                   # decay from s to the end
    new_state = state * log_decay[-1].exp()[:, None, None] + torch.einsum(
        "sh,shp,shn->hpn", to_end, x_dt, B)
    return y, new_state


def ssd_state_update_ref(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                         A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         D: torch.Tensor) -> torch.Tensor:
    """One decode step for a batch, in place on `state` [S, H, P, N]: x [S, H, P], dt [S, H]
    (discretized), B and C [S, G, N]. Returns y [S, H, P] in float32."""
    num_heads = x.shape[1]
    xf, B, C = x.float(), _heads(B, num_heads), _heads(C, num_heads)
    decay = torch.exp(dt * A.float())[..., None, None]
    new_state = state.float() * decay + (dt[..., None] * xf)[..., None] * B[:, :, None, :]
    state.copy_(new_state)
    y = torch.einsum("shpn,shn->shp", new_state, C)
    return y + D.float()[:, None] * xf


def causal_conv1d_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's prefill through the depthwise causal conv + SiLU: x [T, D], conv_state
    [D, K-1] (the inputs before x; zeros for a new request), weight [D, K]. Returns (out [T, D],
    new conv state)."""
    width = weight.shape[-1] - 1
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)    # [D, K-1+T]
    out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), bias, groups=x.shape[1])[0]
    return F.silu(out).t(), window[:, window.shape[1] - width:]


def causal_conv1d_step_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """One decode step for a batch: x [S, D], conv_state [S, D, K-1] updated in place."""
    window = torch.cat([conv_state.to(x.dtype), x[..., None]], dim=-1)    # [S, D, K]
    out = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    conv_state.copy_(window[..., 1:])
    return F.silu(out)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       group_size: int, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x * silu(gate)), the norm taken over each group of `group_size`
    channels separately (NemotronH norms each of its n_groups apart), float32 inside."""
    h = x.float() * F.silu(gate.float())
    grouped = h.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.flatten(-2).to(x.dtype)
