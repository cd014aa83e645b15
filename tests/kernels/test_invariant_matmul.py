"""The batch-invariant GEMM of deterministic mode (tllm.kernels.triton.invariant_matmul)
against its float64 reference, N and K off the block sizes, and a row's product the same
bits at any M and any place in its tile (on the GPU, or under the Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.triton.invariant_matmul import (invariant_matmul,  # noqa: E402
                                                  invariant_matmul_ref)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_matches_the_reference(device, dtype, m):
    x = torch.randn(m, 100, device=device).to(dtype)
    w = (torch.randn(70, 100, device=device) / 10).to(dtype)
    out = invariant_matmul(x, w)
    assert out.shape == (m, 70) and out.dtype == dtype
    assert relative_error(out.float(), invariant_matmul_ref(x.float(), w.float())) < TOL[dtype]


def test_a_row_is_the_same_bits_at_any_batch(device):
    w = torch.randn(70, 100, device=device).to(torch.bfloat16)
    probe = torch.randn(100, device=device).to(torch.bfloat16)
    results = set()
    for m, at in ((1, 0), (3, 2), (33, 17), (40, 39)):
        x = torch.randn(m, 100, device=device).to(torch.bfloat16)
        x[at] = probe
        results.add(invariant_matmul(x, w)[at].float().cpu().numpy().tobytes())
    assert len(results) == 1


def test_deterministic_mode_routes_plain_linears_and_the_lm_head_to_it(device):
    """What make_batch_invariant does on CUDA, applied here to layers on this device."""
    import torch.nn.functional as F
    from tllm.layers.batch_invariant import _use_invariant_matmul
    from tllm.layers.embedding import LMHead
    from tllm.layers.linear import Linear
    linear, head = Linear(100, 70).to(device), LMHead(90, 100).to(device)
    for layer in (linear, head):
        layer.weight.data.normal_()
        _use_invariant_matmul(layer)
    x = torch.randn(3, 100, device=device)
    assert type(linear.quant).__name__ == "_InvariantMatmulMethod"
    assert linear.quant.plain_weight  # the wrapped method's attributes read through
    for layer in (linear, head):
        assert relative_error(layer(x), F.linear(x, layer.weight)) < 1e-5
