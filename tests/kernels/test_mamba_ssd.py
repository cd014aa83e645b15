"""The Triton SSD kernels (single-step update, varlen chunked scan) against the torch
references in tllm/kernels/mamba_ref.py, tiny shapes, states read and written at slots."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.kernels import mamba_ref  # noqa: E402
from tllm.kernels.triton.mamba_ssd import ssd_chunk_scan, ssd_state_update  # noqa: E402

H, P, G, N = 4, 8, 2, 8


def _params(device):
    torch.manual_seed(0)
    return (torch.randn(H, device=device) * 0.5, -torch.rand(H, device=device) - 0.1,
            torch.randn(H, device=device))


def _inputs(num, device):
    return (torch.randn(num, H, P, device=device), torch.randn(num, H, device=device),
            torch.randn(num, G, N, device=device), torch.randn(num, G, N, device=device))


def test_state_update(device):
    dt_bias, A, D = _params(device)
    state = torch.randn(5, H, P, N, device=device)
    slots = torch.tensor([3, 0, 4], device=device)
    x, dt, B, C = _inputs(3, device)
    want_state = state[slots].clone()
    want = mamba_ref.ssd_state_update_ref(want_state, x, mamba_ref.discretize_dt(dt, dt_bias),
                                          A, B, C, D)
    got = ssd_state_update(state, slots, x, dt, dt_bias, A, B, C, D)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state[slots], want_state, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_scan_varlen(device, chunk_size):
    dt_bias, A, D = _params(device)
    lens, slots = [21, 5, 1], [1, 3, 0]
    state = torch.randn(4, H, P, N, device=device) * 0.5
    x, dt, B, C = _inputs(sum(lens), device)
    cu = torch.tensor([0, 21, 26, 27], dtype=torch.int32, device=device)
    wants, want_states = [], []
    for i, slot in enumerate(slots):
        part = slice(int(cu[i]), int(cu[i + 1]))
        y, s = mamba_ref.ssd_chunk_scan_ref(x[part], mamba_ref.discretize_dt(dt[part], dt_bias),
                                            A, B[part], C[part], D, state[slot], chunk_size=8)
        wants.append(y)
        want_states.append(s)
    got = ssd_chunk_scan(state, torch.tensor(slots, device=device), cu, x, dt, dt_bias, A, B,
                         C, D, chunk_size)
    torch.testing.assert_close(got, torch.cat(wants), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[slots], torch.stack(want_states), atol=1e-4, rtol=1e-4)


def test_mixer_with_kernels_matches_hf(device):
    pytest.importorskip("transformers")
    from tests.layers.test_mamba2_mixer import check_against_hf
    check_against_hf(use_triton=True, device=device)


@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_varlen(device, with_bias):
    from tllm.kernels.triton.causal_conv1d import causal_conv1d_varlen
    torch.manual_seed(1)
    dim, width = 40, 4
    lens, slots = [19, 1, 2, 1], [2, 0, 3, 1]         # a prefill, decodes, a short chunk
    x = torch.randn(sum(lens), dim, device=device)
    weight = torch.randn(dim, width, device=device)
    bias = torch.randn(dim, device=device) if with_bias else None
    state = torch.randn(4, dim, width - 1, device=device)
    cu = torch.tensor([0, 19, 20, 22, 23], dtype=torch.int32, device=device)
    wants, want_states = [], []
    for i, slot in enumerate(slots):
        out, new_state = mamba_ref.causal_conv1d_ref(x[int(cu[i]):int(cu[i + 1])],
                                                     state[slot], weight, bias)
        wants.append(out)
        want_states.append(new_state.clone())
    got = causal_conv1d_varlen(x, state, torch.tensor(slots, device=device), cu, weight, bias,
                               max(lens))
    torch.testing.assert_close(got, torch.cat(wants), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[slots], torch.stack(want_states), atol=1e-6, rtol=0)
