"""The gated DeltaNet mixer (Qwen3-Next's `linear_attention` layers) over a flattened batch
of requests, each reading and writing its own state slot: in_proj_qkvz / in_proj_ba ->
causal depthwise conv1d over q, k, v -> gated delta rule -> per-head RMSNorm gated by
SiLU(z) -> out_proj. A request's segment of more than one token runs the chunked form from
its slot's state (so chunked prefill composes); one-token segments (decode) take the
single-step form together.

It shares the Mamba-2 mixer's machinery (layers/mamba2.py): the same MambaBatch (slots,
starts, checkpoint saves split into passes), the same conv, and the same per-layer state
container, whose `ssm` tensor holds the recurrent state [slots, Hv, Dk, Dv] here, so the
state cache and its prefix-reuse checkpoints treat both kinds alike. `use_triton` as in the
Mamba-2 mixer: the Triton conv and delta-rule kernels (kernels/triton/gated_delta.py) on CUDA
tensors, torch otherwise."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tllm.kernels import gated_delta_ref
from tllm.layers.linear import Linear
from tllm.layers.mamba2 import (LayerStateSpec, MambaBatch, MambaLayerState, conv_segments,
                                conv_segments_triton, conv_step_slots, reset_new_requests,
                                run_passes, save_states, segments)
from tllm.layers.state_batch import DecodeSlots, DeferredBatch


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """The layer's geometry, read from the model config."""
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class DeltaNetStateSpec(LayerStateSpec):
    """`num_layers` gated DeltaNet layers on this rank: a conv state and a recurrent state
    (in `state_dtype`) each, in MambaLayerState's two fields."""
    dims: GatedDeltaNetDims
    num_layers: int
    state_dtype: torch.dtype = torch.float32

    def empty_layer(self, num_rows: int, dtype: torch.dtype,
                    device: torch.device | str) -> MambaLayerState:
        d = self.dims
        conv = torch.zeros(num_rows, d.conv_dim, d.conv_kernel - 1, dtype=dtype, device=device)
        recurrent = torch.zeros(num_rows, d.num_v_heads, d.head_k_dim, d.head_v_dim,
                                dtype=self.state_dtype, device=device)
        return MambaLayerState(conv, recurrent)

    def with_state_dtype(self, dtype: torch.dtype) -> "DeltaNetStateSpec":
        return replace(self, state_dtype=dtype)


class GatedDeltaNet(nn.Module):
    """Parameter names follow the HF checkpoint (in_proj_qkvz, in_proj_ba, conv1d, dt_bias,
    A_log, norm, out_proj) so weights load by name."""

    def __init__(self, dims: GatedDeltaNetDims) -> None:
        super().__init__()
        self.dims = d = dims
        self.in_proj_qkvz = Linear(d.hidden_size, 2 * d.key_dim + 2 * d.value_dim)
        self.in_proj_ba = Linear(d.hidden_size, 2 * d.num_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel),
                                          requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(d.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(d.num_v_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(d.head_v_dim), requires_grad=False)
        self.out_proj = Linear(d.value_dim, d.hidden_size)
        self.use_triton: bool | None = None    # None: on CUDA tensors; tests force it

    def _uses_triton(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.use_triton is None else self.use_triton

    def forward(self, hidden: torch.Tensor, batch: MambaBatch | DecodeSlots | DeferredBatch,
                state: MambaLayerState) -> torch.Tensor:
        qkv, z, b, a = self._project(hidden)
        if isinstance(batch, DeferredBatch):   # piecewise capture: runs between the pieces
            y = batch.defer(self._core, (qkv, b, a), state, like=z)
        else:
            y = self._core(qkv, b, a, state, batch)
        y = gated_rms_norm(y, z, self.norm.weight, self.dims.eps)
        return self.out_proj(y.flatten(-2))

    def _core(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
              state: MambaLayerState, batch: MambaBatch | DecodeSlots) -> torch.Tensor:
        """conv -> gated delta rule, reading and advancing the requests' state: y [T, Hv,
        Dv] in qkv's dtype (as HF's layer casts back before its norm)."""
        use_triton = self._uses_triton(qkv)
        weight = self.conv1d.weight[:, 0]
        if isinstance(batch, DecodeSlots):  # one token each, device slots (graph-safe)
            out = conv_step_slots(qkv, batch.slots, state.conv, weight, None, use_triton)
            return self._delta_step(*self._rule_inputs(out, b, a), batch.slots,
                                    state).to(qkv.dtype)
        reset_new_requests(batch, state)
        passes = batch.passes()
        conv = conv_segments_triton if use_triton else conv_segments
        out = run_passes(lambda sub, t: conv(t, sub, state.conv, weight, None),
                         (qkv,), passes, lambda saves: save_states(saves, state, conv=True))
        rule = self._delta_rule_triton if use_triton else self._delta_rule
        y = run_passes(lambda sub, *t: rule(*t, sub, state), self._rule_inputs(out, b, a),
                       passes, lambda saves: save_states(saves, state, conv=False))
        return y.to(qkv.dtype)

    def _rule_inputs(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """(q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]) from the conv's output."""
        d = self.dims
        q, k, v = qkv.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        return (q.unflatten(-1, (d.num_k_heads, d.head_k_dim)),
                k.unflatten(-1, (d.num_k_heads, d.head_k_dim)),
                v.unflatten(-1, (d.num_v_heads, d.head_v_dim)),
                -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float()),
                b.float().sigmoid())

    def _delta_step(self, q, k, v, g, beta, slots: torch.Tensor,
                    state: MambaLayerState) -> torch.Tensor:
        """The single-step rule for one token per request at `slots` (a device tensor)."""
        if self._uses_triton(v):
            from tllm.kernels.triton.gated_delta import gated_delta_step
            return gated_delta_step(state.ssm, slots, q, k, v, g, beta,
                                    self.dims.head_k_dim ** -0.5)
        q, k = self._queries_keys(q, k)
        recurrent = state.ssm[slots].float()
        out = gated_delta_ref.gated_delta_step_ref(q, k, v, g, beta, recurrent)
        state.ssm[slots] = recurrent.to(state.ssm.dtype)
        return out

    def _project(self, hidden: torch.Tensor):
        """(q|k|v [T, conv_dim], z [T, Hv, Dv], b, a [T, Hv]). The checkpoint groups the
        projections' rows by key head: [q, k, v, z] and [b, a] of each key head in turn."""
        d = self.dims
        per_k = d.num_v_heads // d.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).unflatten(-1, (d.num_k_heads, -1))
        q, k, v, z = qkvz.split([d.head_k_dim, d.head_k_dim, per_k * d.head_v_dim,
                                 per_k * d.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (d.num_k_heads, -1)).split(
            [per_k, per_k], dim=-1)
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        return qkv, z.reshape(-1, d.num_v_heads, d.head_v_dim), b.flatten(1), a.flatten(1)

    def _queries_keys(self, q: torch.Tensor, k: torch.Tensor):
        """q, k [T, Hk, Dk] L2-normalised and repeated to the value heads (each key head
        serves consecutive value heads), q scaled by head_k_dim^-0.5; float32."""
        d = self.dims
        per_k = d.num_v_heads // d.num_k_heads
        q, k = (gated_delta_ref.l2_normalize(t.float()).repeat_interleave(per_k, dim=1)
                for t in (q, k))
        return q * d.head_k_dim ** -0.5, k

    def _delta_rule(self, q, k, v, g, beta, batch: MambaBatch,
                    state: MambaLayerState) -> torch.Tensor:
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        decode_rows, decode_slots = [], []
        for start, length, slot in segments(batch):
            if length == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
                continue
            part = slice(start, start + length)
            qn, kn = self._queries_keys(q[part], k[part])
            out[part], final = gated_delta_ref.gated_delta_chunked_ref(
                qn, kn, v[part], g[part], beta[part], state.ssm[slot], self.dims.chunk_size)
            state.ssm[slot] = final
        if decode_rows:
            rows = torch.tensor(decode_rows, device=v.device)
            out[rows] = self._delta_step(*_rows((q, k, v, g, beta), rows),
                                         torch.tensor(decode_slots, device=v.device), state)
        return out

    def _delta_rule_triton(self, q, k, v, g, beta, batch: MambaBatch,
                           state: MambaLayerState) -> torch.Tensor:
        """All prefill segments in one launch, all decode rows in another (a step of one
        kind reads its inputs where they lie); the kernels normalise and scale q and k
        themselves (raw, per key head, here)."""
        from tllm.kernels.triton.gated_delta import gated_delta_prefill
        scale, inputs, device = self.dims.head_k_dim ** -0.5, (q, k, v, g, beta), v.device
        parts = list(segments(batch))
        prefill = [(s, n, slot) for s, n, slot in parts if n > 1]
        decode = [(s, slot) for s, n, slot in parts if n == 1]
        cu = torch.tensor([0] + [n for _, n, _ in prefill]).cumsum(0).to(torch.int32)
        prefill_slots = torch.tensor([slot for *_, slot in prefill], device=device)
        decode_slots = torch.tensor([slot for _, slot in decode], device=device)
        max_len = max((n for _, n, _ in prefill), default=0)
        if not decode:
            return gated_delta_prefill(state.ssm, prefill_slots, cu.to(device), *inputs, scale,
                                       max_len=max_len)
        if not prefill:
            return self._delta_step(*inputs, decode_slots, state)
        out = torch.empty(v.shape, dtype=torch.float32, device=device)
        rows = torch.cat([torch.arange(s, s + n) for s, n, _ in prefill]).to(device)
        out[rows] = gated_delta_prefill(state.ssm, prefill_slots, cu.to(device),
                                        *_rows(inputs, rows), scale, max_len=max_len)
        rows = torch.tensor([s for s, _ in decode], device=device)
        out[rows] = self._delta_step(*_rows(inputs, rows), decode_slots, state)
        return out


def _rows(tensors, rows: torch.Tensor) -> list[torch.Tensor]:
    """The tokens `rows` of each tensor (a gather: each token's row contiguous)."""
    return [t[rows] for t in tensors]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim, the norm before the gate (Mamba's
    gates first), float32 inside, in `gate`'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * h.to(gate.dtype)).float() * F.silu(gate.float())).to(gate.dtype)
