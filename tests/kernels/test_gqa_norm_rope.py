"""The grouped-query QK-norm + rotate-half RoPE kernel (Cosmos 3) vs its torch reference."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.triton.gqa_norm_rope import gqa_norm_rope, gqa_norm_rope_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# The Triton interpreter's float32 -> bf16 casts inside a kernel land about 1% (norm-relative)
# off the torch reference after the norm's two roundings (the MMDiT kernel shows the same on
# these shapes); on a GPU the bf16 bound is the usual 1e-2.
INTERPRETED_BF16_TOL = 2e-2


def _tol(device, dtype):
    if dtype == torch.bfloat16 and device.type == "cpu":
        return INTERPRETED_BF16_TOL
    return TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q,num_kv,head_dim", [(4, 2, 16), (3, 1, 24)])
@pytest.mark.parametrize("q_norm,k_norm", [(True, True), (False, False), (True, False)])
def test_gqa_norm_rope(device, dtype, num_q, num_kv, head_dim, q_norm, k_norm):
    tokens, offset = 7, 3
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim + 5, device=device).mul(2)
    qkv = qkv.to(dtype)[:, 5:]      # a strided view, as a slice of a wider projection is
    weights = [torch.randn(head_dim, device=device).to(dtype) if on else None
               for on in (q_norm, k_norm)]
    angles = torch.randn(tokens, head_dim // 2, device=device) * 3
    cos, sin = angles.cos(), angles.sin()
    q = torch.full((tokens, num_q, head_dim), float("nan"), device=device, dtype=dtype)
    # keys and values land at rows offset.. of larger buffers, as the joint key buffer has it
    k_buf, v_buf = (torch.full((tokens + offset, num_kv, head_dim), float("nan"), device=device,
                               dtype=dtype) for _ in range(2))
    gqa_norm_rope(qkv, *weights, cos, sin, 1e-6, q, k_buf[offset:], v_buf[offset:])
    want_q, want_k, want_v = gqa_norm_rope_ref(qkv, *weights, cos, sin, 1e-6, num_kv, head_dim)
    assert relative_error(q, want_q) < _tol(device, dtype)
    assert relative_error(k_buf[offset:], want_k) < _tol(device, dtype)
    assert torch.equal(v_buf[offset:], want_v)
    assert k_buf[:offset].isnan().all()     # nothing written outside the rows given

    # keys alone (a second normalisation of the same keys)
    k_only = torch.full((tokens, num_kv, head_dim), float("nan"), device=device, dtype=dtype)
    gqa_norm_rope(qkv, None, weights[0], cos, sin, 1e-6, None, k_only, None)
    _, want_k2, _ = gqa_norm_rope_ref(qkv, None, weights[0], cos, sin, 1e-6, num_kv, head_dim)
    assert relative_error(k_only, want_k2) < _tol(device, dtype)
