"""Some layers here run their Triton kernels under the interpreter on a CPU (the DeltaNet,
the GGUF linears), which must be switched on before any kernel module is imported: here,
before this folder's test modules import the layers."""
import copy

import pytest
import torch

from tllm.attention.testing import setup_triton_for_tests

setup_triton_for_tests()

from tllm.layers.mamba2 import DecodeSlots, MambaBatch  # noqa: E402  (after the set-up)


# ---- a mixer's decode step as a CUDA graph runs it (test_mamba2_mixer, test_gated_deltanet)

SCRATCH_SLOT = 3      # slots 0-2 are requests' (two live: _DECODE_SLOTS), 3 the scratch row
_DECODE_SLOTS = [2, 0]


def triton_device(use_triton: bool) -> torch.device:
    """Where a test's Triton kernels run: the GPU when there is one, else the interpreter."""
    return torch.device("cuda" if use_triton and torch.cuda.is_available() else "cpu")


@pytest.fixture
def check_decode_slots():
    """check(mixer, state, hidden_size, use_triton): DecodeSlots (device slots, padding rows
    on the scratch slot) against the same decode step as per-request segments (MambaBatch):
    the real rows' outputs and every real slot's state agree."""
    return _check_decode_slots


@torch.no_grad()
def _check_decode_slots(mixer, state, hidden_size: int, use_triton: bool) -> None:
    mixer.use_triton = use_triton
    state.conv.normal_()       # mid-sequence state (both requests past position 0)
    state.ssm.normal_()
    graph_state = copy.deepcopy(state)
    device = state.ssm.device
    x = torch.randn(len(_DECODE_SLOTS), hidden_size, device=device)
    want = mixer(x, MambaBatch([1] * len(_DECODE_SLOTS), _DECODE_SLOTS, [5, 9]), state)
    padded = torch.cat([x, torch.randn(2, hidden_size, device=device)])   # padding rows
    slots = torch.tensor(_DECODE_SLOTS + [SCRATCH_SLOT] * 2, device=device)
    got = mixer(padded, DecodeSlots(slots), graph_state)
    torch.testing.assert_close(got[:len(_DECODE_SLOTS)], want, atol=1e-5, rtol=1e-4)
    for name in ("conv", "ssm"):
        torch.testing.assert_close(getattr(graph_state, name)[:SCRATCH_SLOT],
                                   getattr(state, name)[:SCRATCH_SLOT], atol=1e-5, rtol=1e-4)
