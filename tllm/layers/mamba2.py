"""The Mamba-2 mixer (as NemotronH and Granite 4.0-H use it) over a flattened batch of
requests, each reading and writing its own state slot: in_proj -> causal depthwise conv1d ->
SSD scan -> gated grouped RMSNorm -> out_proj. A request's segment of more than one token is
prefilled with the chunked scan starting from its slot's state (so chunked prefill composes);
one-token segments (decode) go through the single-step update together.

The state lives outside the layer (a MambaLayerState per layer, rows indexed by slot); a new
request's slot must be zeroed before its first token (the state cache does that on
admission)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from tllm.kernels import mamba_ref
from tllm.layers.linear import Linear
from tllm.layers.state_batch import DecodeSlots, DeferredBatch


@dataclass(frozen=True)
class Mamba2Dims:
    """The mixer's geometry, read from the model config."""
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C side by side."""
        return self.inner_size + 2 * self.num_groups * self.state_size


@dataclass
class MambaLayerState:
    """One layer's state for every slot: conv [slots, conv_dim, K-1], ssm [slots, H, P, N];
    `saved`: its checkpoints at block boundaries, rows alike (kv_cache/state_checkpoints.py)."""
    conv: torch.Tensor
    ssm: torch.Tensor
    saved: "MambaLayerState | None" = None

    @classmethod
    def empty(cls, dims: Mamba2Dims, num_slots: int, dtype: torch.dtype,
              device: torch.device | str = "cpu",
              ssm_dtype: torch.dtype = torch.float32) -> "MambaLayerState":
        conv = torch.zeros(num_slots, dims.conv_dim, dims.conv_kernel - 1, dtype=dtype,
                           device=device)
        ssm = torch.zeros(num_slots, dims.num_heads, dims.head_dim, dims.state_size,
                          dtype=ssm_dtype, device=device)
        return cls(conv, ssm)


class LayerStateSpec:
    """What the state cache reads of a model's per-request state spec: `num_layers`,
    `empty_layer` (one layer's zeroed state, rows for slots or checkpoints) and
    `bytes_per_request`, which follows from empty_layer's shapes."""
    num_layers: int

    def empty_layer(self, num_rows: int, dtype: torch.dtype,
                    device: torch.device | str) -> MambaLayerState:
        raise NotImplementedError

    def with_state_dtype(self, dtype: torch.dtype) -> "LayerStateSpec":
        """The same spec with its recurrent state in `dtype` (KvCacheConfig's
        mamba_ssm_cache_dtype)."""
        raise NotImplementedError

    def bytes_per_request(self, conv_dtype: torch.dtype) -> int:
        layer = self.empty_layer(1, conv_dtype, "meta")  # shapes only, no memory
        return self.num_layers * sum(t.numel() * t.element_size()
                                     for t in (layer.conv, layer.ssm))


@dataclass(frozen=True)
class StateSpec(LayerStateSpec):
    """`num_layers` Mamba-2 layers of one geometry on this rank; the SSM state in
    `ssm_dtype` (NemotronH's mamba_ssm_cache_dtype)."""
    dims: Mamba2Dims
    num_layers: int
    ssm_dtype: torch.dtype = torch.float32

    def empty_layer(self, num_rows: int, dtype: torch.dtype,
                    device: torch.device | str) -> MambaLayerState:
        return MambaLayerState.empty(self.dims, num_rows, dtype, device, self.ssm_dtype)

    def with_state_dtype(self, dtype: torch.dtype) -> "StateSpec":
        return replace(self, ssm_dtype=dtype)


@dataclass(frozen=True)
class MambaBatch:
    """Which tokens of the flattened batch belong to which request, and its state slot.
    Requests appear in token order; `seq_lens[i]` tokens of request i use `slots[i]`, and
    `starts[i]` tokens came before them (0: a new or recomputed request, whose slot's state
    is reset first). A request's state after its first `save_after[i]` tokens (0: none) is
    saved into checkpoint row `save_rows[i]`."""
    seq_lens: list[int]
    slots: list[int]
    starts: list[int]
    save_after: Sequence[int] = ()
    save_rows: Sequence[int] = ()

    @classmethod
    def from_metadata(cls, metadata) -> "MambaBatch":
        """The step's requests as AttentionMetadata describes them."""
        queries, contexts = metadata.query_lens_cpu, metadata.seq_lens_cpu
        return cls(queries, metadata.request_slots_cpu,
                   [c - q for q, c in zip(queries, contexts)])

    def passes(self) -> list[tuple["MambaBatch", list[int] | None, list[tuple[int, int]]]]:
        """The batch as one or two passes: (sub-batch, its token rows (None: all), the
        (slot, checkpoint row) saves due after it). A save inside a segment splits it: its
        first part runs in the first pass, the rest (with every other segment) in the
        second."""
        if not self.save_after:
            return [(self, None, [])]
        first, rest = _Pass(), _Pass()
        offset = 0
        for length, slot, start, k, row in zip(self.seq_lens, self.slots, self.starts,
                                               self.save_after, self.save_rows):
            if 0 < k < length:
                first.add(offset, k, slot, start, (slot, row))
                rest.add(offset + k, length - k, slot, start + k, None)
            else:
                rest.add(offset, length, slot, start, (slot, row) if k == length else None)
            offset += length
        if not first.rows:
            return [(self, None, rest.saves)]
        return [first.result(), rest.result()]


@dataclass
class _Pass:
    """A sub-batch being built (MambaBatch.passes)."""
    seq_lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)

    def add(self, offset: int, length: int, slot: int, start: int, save) -> None:
        self.seq_lens.append(length)
        self.slots.append(slot)
        self.starts.append(start)
        self.rows.extend(range(offset, offset + length))
        if save is not None:
            self.saves.append(save)

    def result(self):
        return MambaBatch(self.seq_lens, self.slots, self.starts), self.rows, self.saves


class Mamba2Mixer(nn.Module):
    """Parameter names follow the HF checkpoint (in_proj, conv1d, dt_bias, A_log, D, norm,
    out_proj) so weights load by name."""

    def __init__(self, dims: Mamba2Dims) -> None:
        super().__init__()
        self.dims = dims
        d = dims
        self.in_proj = Linear(d.hidden_size, d.inner_size + d.conv_dim + d.num_heads,
                              bias=d.proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel),
                                          requires_grad=False)
        self.conv1d.bias = (nn.Parameter(torch.empty(d.conv_dim), requires_grad=False)
                            if d.conv_bias else None)
        self.dt_bias = nn.Parameter(torch.empty(d.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(d.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(d.num_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(d.inner_size), requires_grad=False)
        self.out_proj = Linear(d.inner_size, d.hidden_size, bias=d.proj_bias)
        self.use_triton: bool | None = None    # None: on CUDA tensors; tests force it

    def _uses_triton(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.use_triton is None else self.use_triton

    def forward(self, hidden: torch.Tensor, batch: MambaBatch | DecodeSlots | DeferredBatch,
                state: MambaLayerState) -> torch.Tensor:
        d = self.dims
        gate, xbc, dt = self.in_proj(hidden).split([d.inner_size, d.conv_dim, d.num_heads], -1)
        if isinstance(batch, DeferredBatch):   # piecewise capture: runs between the pieces
            y = batch.defer(self._core, (xbc, dt), state, like=gate)
        else:
            y = self._core(xbc, dt, state, batch)
        y = mamba_ref.gated_rms_norm_ref(y, gate, self.norm.weight,
                                         d.inner_size // d.num_groups, d.eps)
        return self.out_proj(y)

    def _core(self, xbc: torch.Tensor, dt: torch.Tensor, state: MambaLayerState,
              batch: MambaBatch | DecodeSlots) -> torch.Tensor:
        """conv -> SSD scan, reading and advancing the requests' state: y [T, inner] in
        xbc's dtype."""
        d = self.dims
        if isinstance(batch, DecodeSlots):
            return self._decode_core(xbc, dt, state, batch.slots)
        reset_new_requests(batch, state)
        use_triton = self._uses_triton(xbc)
        passes = batch.passes()
        conv = self._conv_triton if use_triton else self._conv
        xbc = run_passes(lambda sub, t: conv(t, sub, state), (xbc,), passes,
                          lambda saves: save_states(saves, state, conv=True))
        x, B, C = self._split_xbc(xbc)
        scan = self._scan_triton if use_triton else self._scan
        y = run_passes(lambda sub, *t: scan(*t, sub, state), (x, dt, B, C), passes,
                        lambda saves: save_states(saves, state, conv=False))
        return y.flatten(-2).to(xbc.dtype)

    def _split_xbc(self, xbc: torch.Tensor):
        """x [T, H, P], B and C [T, G, N] from the conv's output."""
        d = self.dims
        x, B, C = xbc.split([d.inner_size, d.num_groups * d.state_size,
                             d.num_groups * d.state_size], dim=-1)
        return (x.unflatten(-1, (d.num_heads, d.head_dim)),
                B.unflatten(-1, (d.num_groups, d.state_size)),
                C.unflatten(-1, (d.num_groups, d.state_size)))

    def _decode_core(self, xbc: torch.Tensor, dt: torch.Tensor, state: MambaLayerState,
                     slots: torch.Tensor) -> torch.Tensor:
        """One token per request (DecodeSlots): no host value read, so a graph captures it."""
        use_triton = self._uses_triton(xbc)
        out = conv_step_slots(xbc, slots, state.conv, self.conv1d.weight[:, 0],
                              self.conv1d.bias, use_triton)
        x, B, C = self._split_xbc(out)
        return self._state_update(x, dt, B, C, slots, state).flatten(-2).to(xbc.dtype)

    def _state_update(self, x, dt, B, C, slots: torch.Tensor,
                      state: MambaLayerState) -> torch.Tensor:
        """The single-step update of one token per row at `slots` (dt raw): y fp32."""
        if self._uses_triton(x):
            from tllm.kernels.triton.mamba_ssd import ssd_state_update
            return ssd_state_update(state.ssm, slots, x, dt, self.dt_bias,
                                    -torch.exp(self.A_log.float()), B, C, self.D,
                                    self.dims.dt_limit)
        ssm = state.ssm[slots]
        y = mamba_ref.ssd_state_update_ref(
            ssm, x, mamba_ref.discretize_dt(dt, self.dt_bias, self.dims.dt_limit),
            -torch.exp(self.A_log.float()), B, C, self.D)
        state.ssm[slots] = ssm
        return y

    def _conv(self, xbc: torch.Tensor, batch: MambaBatch,
              state: MambaLayerState) -> torch.Tensor:
        return conv_segments(xbc, batch, state.conv, self.conv1d.weight[:, 0],
                             self.conv1d.bias)

    def _conv_triton(self, xbc: torch.Tensor, batch: MambaBatch,
                     state: MambaLayerState) -> torch.Tensor:
        return conv_segments_triton(xbc, batch, state.conv, self.conv1d.weight[:, 0],
                                    self.conv1d.bias)

    def _scan(self, x, dt, B, C, batch: MambaBatch, state: MambaLayerState) -> torch.Tensor:
        A = -torch.exp(self.A_log.float())
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        decode_rows, decode_slots = [], []
        for start, length, slot in segments(batch):
            if length == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
                continue
            part = slice(start, start + length)
            y[part], final = mamba_ref.ssd_chunk_scan_ref(
                x[part], mamba_ref.discretize_dt(dt[part], self.dt_bias, self.dims.dt_limit),
                A, B[part], C[part], self.D, state.ssm[slot], self.dims.chunk_size)
            state.ssm[slot] = final
        if decode_rows:
            rows = torch.tensor(decode_rows, device=x.device)
            y[rows] = self._state_update(x[rows], dt[rows], B[rows], C[rows],
                                         torch.tensor(decode_slots, device=x.device), state)
        return y


    def _scan_triton(self, x, dt, B, C, batch: MambaBatch,
                     state: MambaLayerState) -> torch.Tensor:
        """All prefill segments in one chunked-scan launch, all decode rows in one update."""
        from tllm.kernels.triton.mamba_ssd import ssd_chunk_scan
        A = -torch.exp(self.A_log.float())
        args = (self.dt_bias, A)
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        parts = list(segments(batch))
        prefill = [(s, n, slot) for s, n, slot in parts if n > 1]
        decode = [(s, slot) for s, n, slot in parts if n == 1]
        if prefill:
            rows = torch.cat([torch.arange(s, s + n) for s, n, _ in prefill]).to(x.device)
            lens = torch.tensor([0] + [n for _, n, _ in prefill])
            cu = lens.cumsum(0).to(torch.int32).to(x.device)
            slots = torch.tensor([slot for *_, slot in prefill], device=x.device)
            y[rows] = ssd_chunk_scan(state.ssm, slots, cu, x[rows], dt[rows], *args, B[rows],
                                     C[rows], self.D, self.dims.chunk_size, self.dims.dt_limit)
        if decode:
            rows = torch.tensor([s for s, _ in decode], device=x.device)
            slots = torch.tensor([slot for _, slot in decode], device=x.device)
            y[rows] = self._state_update(x[rows], dt[rows], B[rows], C[rows], slots, state)
        return y


def conv_segments(x: torch.Tensor, batch: MambaBatch, conv_state: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv + SiLU over each request's segment, from and into its
    slot's row of `conv_state` [slots, D, K-1]: prefill segments one by one, one-token
    segments (decode) together. Gated DeltaNet's conv runs through here too."""
    out = torch.empty_like(x)
    decode_rows, decode_slots = [], []
    for start, length, slot in segments(batch):
        if length == 1:
            decode_rows.append(start)
            decode_slots.append(slot)
            continue
        part, conv_state[slot] = mamba_ref.causal_conv1d_ref(
            x[start:start + length], conv_state[slot], weight, bias)
        out[start:start + length] = part
    if decode_rows:
        rows = torch.tensor(decode_rows, device=x.device)
        out[rows] = conv_step_slots(x[rows], torch.tensor(decode_slots, device=x.device),
                                    conv_state, weight, bias, use_triton=False)
    return out


def conv_segments_triton(x: torch.Tensor, batch: MambaBatch, conv_state: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """conv_segments in Triton: every request (prefill chunk or decode) in one pair of
    launches."""
    from tllm.kernels.triton.causal_conv1d import causal_conv1d_varlen
    cu = torch.tensor([0, *batch.seq_lens]).cumsum(0).to(torch.int32).to(x.device)
    slots = torch.tensor(batch.slots, device=x.device)
    return causal_conv1d_varlen(x.contiguous(), conv_state, slots, cu, weight, bias,
                                max(batch.seq_lens, default=0))


def conv_step_slots(x: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None,
                    use_triton: bool) -> torch.Tensor:
    """One token per request (row i at slot slots[i]): the conv + SiLU step, each slot's row
    of `conv_state` advanced in place; device tensors only (DecodeSlots)."""
    if use_triton:
        from tllm.kernels.triton.causal_conv1d import causal_conv1d_varlen
        cu = DecodeSlots(slots).cu_seqlens()
        return causal_conv1d_varlen(x.contiguous(), conv_state, slots, cu, weight, bias, 1)
    rows = conv_state[slots]
    out = mamba_ref.causal_conv1d_step_ref(x, rows, weight, bias)
    conv_state[slots] = rows
    return out


def run_passes(fn, inputs: tuple[torch.Tensor, ...], passes, save) -> torch.Tensor:
    """fn(sub-batch, *inputs' rows) over each pass (MambaBatch.passes), `save(saves)` after
    each; the outputs put back in token order."""
    if len(passes) == 1:
        sub, _, saves = passes[0]
        out = fn(sub, *inputs)
        save(saves)
        return out
    parts = []
    for sub, rows, saves in passes:
        index = torch.tensor(rows, device=inputs[0].device)
        parts.append((index, fn(sub, *(t[index] for t in inputs))))
        save(saves)
    out = parts[0][1].new_empty((inputs[0].shape[0], *parts[0][1].shape[1:]))
    for index, part in parts:
        out[index] = part
    return out


def save_states(saves: list[tuple[int, int]], state: MambaLayerState, conv: bool) -> None:
    """Copy slots' conv (or SSM) state into checkpoint rows (`saves`: (slot, row) pairs)."""
    if saves:
        source, saved = ((state.conv, state.saved.conv) if conv
                         else (state.ssm, state.saved.ssm))
        slots = torch.tensor([s for s, _ in saves], device=source.device)
        rows = torch.tensor([r for _, r in saves], device=source.device)
        saved.index_copy_(0, rows, source[slots])


def reset_new_requests(batch: MambaBatch, *states: MambaLayerState) -> None:
    """A request at position 0 starts from zero state, whatever its slot held before (in
    each layer's `states`)."""
    fresh = [slot for slot, start in zip(batch.slots, batch.starts) if start == 0]
    if fresh:
        rows = torch.tensor(fresh, device=states[0].ssm.device)
        for state in states:
            state.conv.index_fill_(0, rows, 0)
            state.ssm.index_fill_(0, rows, 0)


def segments(batch: MambaBatch):
    """(first token row, number of tokens, slot) per request."""
    start = 0
    for length, slot in zip(batch.seq_lens, batch.slots):
        yield start, length, slot
        start += length
