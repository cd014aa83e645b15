"""MMDiT elementwise kernels (AdaLN modulation, QK-norm + RoPE) vs their torch references."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.triton.mmdit import (adaln_modulate, adaln_modulate_ref,  # noqa: E402
                                       qk_norm_rope, qk_norm_rope_ref)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _mod_params(batch, groups, dim, dtype, device):
    """shift, scale, gate as views of one [G * B, 3 * d] tensor, as a block's linear makes them."""
    mod = torch.randn(groups * batch, 3 * dim, device=device).mul(0.5).to(dtype)
    p = mod.view(groups, batch, 3, dim).transpose(0, 1)
    return p[:, :, 0], p[:, :, 1], p[:, :, 2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,split", [(1, None), (2, 5)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_adaln_modulate(device, dtype, groups, split, with_residual):
    batch, n_tokens, dim = 2, 9, 96
    x = torch.randn(batch, n_tokens, dim, device=device).mul(3).add(1).to(dtype)
    shift, scale, gate = _mod_params(batch, groups, dim, dtype, device)
    residual = None
    if with_residual:  # y as a strided view, as an attention output slice is
        residual = (torch.randn(batch, n_tokens + 4, dim, device=device).to(dtype)[:, 4:], gate)
    got = adaln_modulate(x, shift, scale, 1e-6, split, residual)
    want = adaln_modulate_ref(x, shift, scale, 1e-6, split, residual)
    if with_residual:
        assert relative_error(got[0], want[0]) < TOL[dtype]
        got, want = got[1], want[1]
    assert got.dtype == dtype and got.shape == x.shape
    assert relative_error(got, want) < TOL[dtype]


def test_adaln_modulate_groups_differ(device):
    """With two groups, tokens past the split really use the second group's parameters."""
    x = torch.randn(1, 6, 32, device=device)
    shift, scale, _ = _mod_params(1, 2, 32, torch.float32, device)
    got = adaln_modulate(x, shift, scale, 1e-6, split=2)
    first = adaln_modulate(x, shift[:, :1], scale[:, :1], 1e-6)
    second = adaln_modulate(x, shift[:, 1:], scale[:, 1:], 1e-6)
    torch.testing.assert_close(got[:, :2], first[:, :2])
    torch.testing.assert_close(got[:, 2:], second[:, 2:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", [(3, 32), (2, 128), (4, 24)])
def test_qk_norm_rope(device, dtype, num_heads, head_dim):
    batch, n_tokens, offset, seq = 2, 7, 3, 12
    width = num_heads * head_dim
    qkv = torch.randn(batch, n_tokens, 3 * width, device=device).mul(2).to(dtype)
    q_w, k_w = (torch.randn(head_dim, device=device).to(dtype) for _ in range(2))
    angles = torch.randn(n_tokens, head_dim // 2, device=device) * 4
    cos, sin = angles.cos(), angles.sin()
    out = tuple(torch.full((batch, seq, num_heads, head_dim), float("nan"), dtype=dtype,
                           device=device) for _ in range(3))
    qk_norm_rope(qkv, q_w, k_w, cos, sin, 1e-6, out, offset)
    want = qk_norm_rope_ref(qkv, q_w, k_w, cos, sin, 1e-6, num_heads)
    for got, ref in zip(out, want):
        window = got[:, offset:offset + n_tokens]
        assert relative_error(window, ref) < TOL[dtype]
        assert got[:, :offset].isnan().all() and got[:, offset + n_tokens:].isnan().all()
    assert torch.equal(out[2][:, offset:offset + n_tokens], want[2])


def test_qk_norm_rope_matches_complex_rotation(device):
    """The pair convention is diffusers': (x[2i], x[2i+1]) rotated as one complex number."""
    qkv = torch.randn(1, 5, 3 * 2 * 16, device=device)
    ones = torch.ones(16, device=device)
    angles = torch.randn(5, 8, device=device)
    q, _, _ = qk_norm_rope_ref(qkv, ones, ones, angles.cos(), angles.sin(), 1e-6, 2)
    x = qkv[..., :32].unflatten(-1, (2, 16))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    rotated = torch.view_as_complex(x.reshape(1, 5, 2, 8, 2)) * torch.polar(
        torch.ones_like(angles), angles)[:, None]
    torch.testing.assert_close(q, torch.view_as_real(rotated).flatten(-2))
