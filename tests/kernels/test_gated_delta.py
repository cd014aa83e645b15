"""The Triton gated delta rule kernels (single-step decode, varlen prefill) against the torch
references in tllm/kernels/gated_delta_ref.py: tiny shapes, random states and inputs, states
read and written at their slots and the other slots untouched."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.kernels import gated_delta_ref  # noqa: E402
from tllm.kernels.triton.gated_delta import (gated_delta_prefill, prefill_chunk,  # noqa: E402
                                             gated_delta_step)

DK, DV = 8, 12      # DV not a power of two: the masked tail of the value tile
NUM_SLOTS = 5


def _inputs(num_tokens, k_heads, v_heads, device, dtype=torch.float32):
    """Raw q, k (as the kernels take them), v, g (log decay <= 0), beta in (0, 1)."""
    q, k = (torch.randn(num_tokens, k_heads, DK, device=device).to(dtype) for _ in range(2))
    v = torch.randn(num_tokens, v_heads, DV, device=device).to(dtype)
    g = -torch.rand(num_tokens, v_heads, device=device) * 0.5
    beta = torch.rand(num_tokens, v_heads, device=device)
    return q, k, v, g, beta


def _ref_queries_keys(q, k, v_heads):
    """What the reference takes: normalised, repeated to the value heads, q scaled."""
    per_k = v_heads // q.shape[1]
    q, k = (gated_delta_ref.l2_normalize(t.float()).repeat_interleave(per_k, dim=1)
            for t in (q, k))
    return q * DK ** -0.5, k


def _check_state(state, before, slots, want_states, atol):
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    torch.testing.assert_close(state[untouched], before[untouched], atol=0, rtol=0)
    torch.testing.assert_close(state[slots].float(), torch.stack(want_states).float(),
                               atol=atol, rtol=atol)


@pytest.mark.parametrize("k_heads,v_heads", [(1, 1), (2, 4)])
def test_step(device, k_heads, v_heads):
    torch.manual_seed(k_heads + v_heads)
    state = torch.randn(NUM_SLOTS, v_heads, DK, DV, device=device)
    before = state.clone()
    slots = [3, 0, 4]
    q, k, v, g, beta = _inputs(len(slots), k_heads, v_heads, device)
    want_state = state[slots].clone()
    want = gated_delta_ref.gated_delta_step_ref(*_ref_queries_keys(q, k, v_heads), v, g, beta,
                                                want_state)
    got = gated_delta_step(state, torch.tensor(slots, device=device), q, k, v, g, beta,
                           DK ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _check_state(state, before, slots, list(want_state), atol=1e-4)


def _prefill_case(lens, slots, k_heads, v_heads, device, dtype, state_dtype, chunk_size=16):
    """(got, want, state, before, want_states) for one mixed batch."""
    state = torch.randn(NUM_SLOTS, v_heads, DK, DV, device=device).to(state_dtype)
    before = state.clone()
    q, k, v, g, beta = _inputs(sum(lens), k_heads, v_heads, device, dtype)
    rq, rk = _ref_queries_keys(q, k, v_heads)
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    wants, want_states = [], []
    for i, slot in enumerate(slots):
        part = slice(int(cu[i]), int(cu[i + 1]))
        out, final = gated_delta_ref.gated_delta_chunked_ref(
            rq[part], rk[part], v[part], g[part], beta[part], state[slot], chunk_size=4)
        wants.append(out)
        want_states.append(final)
    got = gated_delta_prefill(state, torch.tensor(slots, device=device), cu, q, k, v, g, beta,
                              DK ** -0.5, chunk_size=chunk_size)
    return got, torch.cat(wants), state, before, want_states


@pytest.mark.parametrize("lens,slots,chunk_size", [
    ([9, 1, 3], [1, 3, 0], 16), ([2, 17], [4, 2], 16), ([40, 1, 5], [0, 4, 3], 16),
    ([40, 6], [2, 0], 32)])
@pytest.mark.parametrize("k_heads,v_heads", [(1, 2), (2, 4)])
def test_prefill_varlen(device, lens, slots, chunk_size, k_heads, v_heads):
    """Segments shorter than a chunk, across chunk boundaries, of one token."""
    torch.manual_seed(sum(lens) + v_heads)
    got, want, state, before, want_states = _prefill_case(
        lens, slots, k_heads, v_heads, device, torch.float32, torch.float32, chunk_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _check_state(state, before, slots, want_states, atol=1e-4)


def test_prefill_bf16_inputs_and_state(device):
    """bf16 q, k, v (upcast inside, as the reference does; on the GPU the chunk's dots then
    run in TF32, so 1e-2 there); a bf16 state is rounded once when stored."""
    torch.manual_seed(7)
    got, want, state, before, want_states = _prefill_case(
        [21, 3], [2, 1], 2, 4, device, torch.bfloat16, torch.bfloat16)
    tol = 1e-4 if device.type == "cpu" else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    _check_state(state, before, [2, 1], [s.to(torch.bfloat16) for s in want_states], atol=1e-2)


def test_prefill_then_step_composes(device):
    """Chunked prefill composes: a prompt in two prefill calls, then a decode step, equals
    one prefill of all its tokens."""
    torch.manual_seed(3)
    q, k, v, g, beta = _inputs(10, 2, 2, device)
    slot = torch.tensor([1], device=device)
    whole = torch.randn(2, 2, DK, DV, device=device)
    split = whole.clone()
    want = gated_delta_prefill(whole, slot, torch.tensor([0, 10], device=device,
                                                         dtype=torch.int32),
                               q, k, v, g, beta, DK ** -0.5)
    outs = []
    for a, b in [(0, 6), (6, 9)]:
        cu = torch.tensor([0, b - a], device=device, dtype=torch.int32)
        outs.append(gated_delta_prefill(split, slot, cu, q[a:b], k[a:b], v[a:b], g[a:b],
                                        beta[a:b], DK ** -0.5))
    outs.append(gated_delta_step(split, slot, q[9:], k[9:], v[9:], g[9:], beta[9:],
                                 DK ** -0.5))
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def _layer_and_state(device):
    """A tiny gated DeltaNet layer on random weights and a state whose slots hold stale
    values (a new request must not read them)."""
    from tllm.layers.gated_deltanet import DeltaNetStateSpec, GatedDeltaNet, GatedDeltaNetDims
    dims = GatedDeltaNetDims(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=DK,
                             head_v_dim=DV, conv_kernel=4, eps=1e-5, chunk_size=4)
    layer = GatedDeltaNet(dims).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand_like(layer.A_log).log())
    spec = DeltaNetStateSpec(dims, 1)
    state = spec.empty_layer(NUM_SLOTS, torch.float32, device)
    state.saved = spec.empty_layer(2, torch.float32, device)
    state.conv.normal_()
    state.ssm.normal_()
    return layer, state


STEPS = {   # (seq_lens, slots, starts, save_after, save_rows)
    "mixed": ([7, 1, 5, 1], [3, 0, 1, 4], [0, 9, 4, 2], [0, 0, 2, 0], [-1, -1, 1, -1]),
    "decode": ([1, 1, 1], [2, 4, 0], [5, 0, 8], (), ()),
    "prefill": ([3, 6], [1, 3], [0, 4], [0, 6], [-1, 0]),
}


@pytest.mark.parametrize("step", STEPS)
@torch.no_grad()
def test_layer_triton_equals_torch(device, step):
    """A mixed step (a new prompt, a continued prefill chunk with a checkpoint save inside
    it, two decodes), a decode-only and a prefill-only step: the layer with the kernels
    forced on equals it forced off, outputs, slot states and checkpoints alike."""
    from tllm.layers.mamba2 import MambaBatch
    torch.manual_seed(11)
    layer, state = _layer_and_state(device)
    lens, slots, starts, save_after, save_rows = STEPS[step]
    batch = MambaBatch(lens, slots, starts, save_after=save_after, save_rows=save_rows)
    hidden = torch.randn(sum(lens), 32, device=device)
    results = []
    for use_triton in (False, True):
        layer.use_triton = use_triton
        run_state = type(state)(state.conv.clone(), state.ssm.clone(),
                                type(state)(state.saved.conv.clone(), state.saved.ssm.clone()))
        out = layer(hidden, batch, run_state)
        results.append((out, run_state))
    (want, want_state), (got, got_state) = results
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for name in ("conv", "ssm"):
        torch.testing.assert_close(getattr(got_state, name), getattr(want_state, name),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(getattr(got_state.saved, name),
                                   getattr(want_state.saved, name), atol=1e-4, rtol=1e-4)


def test_prefill_correlated_keys(device):
    """Nearly equal keys, beta near 1, little decay: the chunk's triangular system at its
    worst conditioned; the kernel still equals the token-by-token recurrence."""
    torch.manual_seed(5)
    num_tokens, heads = 40, 2
    q, _, v, _, _ = _inputs(num_tokens, heads, heads, device)
    k = torch.randn(1, heads, DK, device=device) + 0.05 * torch.randn(num_tokens, heads, DK,
                                                                       device=device)
    g = -torch.rand(num_tokens, heads, device=device) * 0.01
    beta = 0.9 + 0.1 * torch.rand(num_tokens, heads, device=device)
    state = torch.randn(1, heads, DK, DV, device=device)
    rows, (rq, rk) = state.clone(), _ref_queries_keys(q, k, heads)
    want = torch.cat([gated_delta_ref.gated_delta_step_ref(
        rq[t:t + 1], rk[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], rows)
        for t in range(num_tokens)])
    cu = torch.tensor([0, num_tokens], device=device, dtype=torch.int32)
    got = gated_delta_prefill(state, torch.tensor([0], device=device), cu, q, k, v, g, beta,
                              DK ** -0.5, chunk_size=32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, rows, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk_size", [16, 64])   # 64: the layer's, cut to fit shared memory
def test_qwen3_next_shapes_on_gpu(dtype, tol, chunk_size):
    """Qwen3-Next-80B's DeltaNet geometry (16 key heads, 32 value heads, 128 x 128 per head):
    a mixed prefill batch, then a decode step on the states it left (compiled kernels only;
    the interpreter would take minutes)."""
    device, heads, dim = torch.device("cuda"), (16, 32), 128
    torch.manual_seed(0)
    lens, slots = [300, 2, 77, 1], [5, 0, 2, 7]
    state = torch.randn(8, heads[1], dim, dim, device=device) * 0.1
    q, k = (torch.randn(sum(lens), heads[0], dim, device=device).to(dtype) for _ in range(2))
    v = torch.randn(sum(lens), heads[1], dim, device=device).to(dtype)
    g = -torch.rand(sum(lens), heads[1], device=device) * 0.5
    beta = torch.rand(sum(lens), heads[1], device=device)
    per_k = heads[1] // heads[0]
    rq, rk = (gated_delta_ref.l2_normalize(t.float()).repeat_interleave(per_k, 1)
              for t in (q, k))
    rq = rq * dim ** -0.5
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    want_states = state[slots].clone()
    wants = []
    for i in range(len(lens)):
        part = slice(int(cu[i]), int(cu[i + 1]))
        out, want_states[i] = gated_delta_ref.gated_delta_chunked_ref(
            rq[part], rk[part], v[part], g[part], beta[part], want_states[i])
        wants.append(out)
    index = torch.tensor(slots, device=device)
    got = gated_delta_prefill(state, index, cu, q, k, v, g, beta, dim ** -0.5,
                              chunk_size=chunk_size)
    torch.testing.assert_close(got, torch.cat(wants), atol=tol, rtol=tol)
    torch.testing.assert_close(state[slots], want_states, atol=tol, rtol=tol)
    last = cu[1:] - 1                      # each request's last token again, as a decode
    want = gated_delta_ref.gated_delta_step_ref(rq[last], rk[last], v[last], g[last],
                                                beta[last], want_states)
    got = gated_delta_step(state, index, q[last], k[last], v[last], g[last], beta[last],
                           dim ** -0.5)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(state[slots], want_states, atol=tol, rtol=tol)


def test_prefill_chunk_fits_shared_memory():
    """The chunk is a power of two in [16, 64], cut where C x Dk passes 2048 elements (at
    C = 64, Dk = 128 the kernel needed more shared memory than an H100 has)."""
    assert [prefill_chunk(c, 32) for c in (1, 16, 24, 32, 64, 128)] == [16, 16, 32, 32, 64, 64]
    assert [prefill_chunk(c, 64) for c in (16, 32, 64)] == [16, 32, 32]
    assert [prefill_chunk(c, 128) for c in (16, 32, 64)] == [16, 16, 16]
    assert prefill_chunk(64, 256) == 16
