"""The Triton kernels as torch custom ops: torch.library.opcheck (schema, fake tensors,
dispatch) on fresh random inputs, each op equal to its kernel wrapper, fake shapes under
FakeTensorMode, and torch.compile tracing a norm + MLP block around the ops without a graph
break (the CPU runs the kernels under the Triton interpreter)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tllm.kernels import custom_ops  # noqa: E402,F401  (registers torch.ops.tllm.*)
from tllm.kernels.triton.activation import silu_and_mul_ref  # noqa: E402
from tllm.kernels.triton.rmsnorm import rms_norm_ref  # noqa: E402

ops = torch.ops.tllm
# opcheck's autograd checks need ops with a backward; ours are inference-only
CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def rope_inputs(device, num_tokens=5, num_heads=4, num_kv_heads=2, head_dim=16, blocks=4,
                tokens_per_block=4):
    q = torch.randn(num_tokens, num_heads, head_dim, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    positions = torch.randint(0, 32, (num_tokens,), device=device)
    angles = torch.rand(32, head_dim // 2, device=device) * math.pi
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    shape = (blocks, tokens_per_block, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, device=device), torch.randn(shape, device=device)
    slots = torch.randperm(blocks * tokens_per_block)[:num_tokens].to(device)
    return positions, q, k, v, cos, sin, k_cache, v_cache, slots


def decode_inputs(device, num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=16, blocks=6,
                  tokens_per_block=4):
    shape = (blocks, tokens_per_block, num_kv_heads, head_dim)
    q = torch.randn(num_seqs, num_heads, head_dim, device=device)
    k_cache, v_cache = torch.randn(shape, device=device), torch.randn(shape, device=device)
    tables = torch.randperm(blocks)[:num_seqs * 3].view(num_seqs, 3).int().to(device)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor([5, 11][:num_seqs], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, starts, seq_lens


def test_rms_norm_ops(device):
    x, r = torch.randn(3, 64, device=device), torch.randn(3, 64, device=device)
    w = torch.randn(64, device=device)
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-6), test_utils=CHECKS)
    torch.library.opcheck(ops.fused_add_rms_norm, (x, r, w, 1e-6), test_utils=CHECKS)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    out, summed = ops.fused_add_rms_norm(x, r, w, 1e-6)
    want_out, want_sum = rms_norm_ref(x, w, 1e-6, r)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(summed, want_sum)


def test_silu_and_mul_op(device):
    x = torch.randn(3, 2, 96, device=device)
    torch.library.opcheck(ops.silu_and_mul, (x,), test_utils=CHECKS)
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_ref(x))


def test_rope_and_write_kv_op_writes_the_caches(device):
    from tllm.kernels.triton.kv_cache import rope_and_write_kv_ref
    args = rope_inputs(device)
    torch.library.opcheck(ops.rope_and_write_kv, args, test_utils=CHECKS)
    got = [a.clone() for a in args]
    want = [a.clone() for a in args]
    q = ops.rope_and_write_kv(*got)
    q_ref = rope_and_write_kv_ref(*want)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(got[6], want[6])   # k_cache
    torch.testing.assert_close(got[7], want[7])   # v_cache


def test_paged_decode_attention_op(device):
    from tllm.kernels.triton.decode_attention import paged_decode_attention
    args = decode_inputs(device)
    torch.library.opcheck(ops.paged_decode_attention, (*args, 12, 0.25), test_utils=CHECKS)
    torch.testing.assert_close(ops.paged_decode_attention(*args, 12, 0.25),
                               paged_decode_attention(*args, max_seq_len=12, scale=0.25))


def test_fake_implementations_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.bfloat16)
        assert ops.rms_norm(x, w, 1e-6).shape == (7, 64)
        out, summed = ops.fused_add_rms_norm(x, x, w, 1e-6)
        assert out.shape == summed.shape == (7, 64) and out.dtype == torch.bfloat16
        assert ops.silu_and_mul(torch.empty(7, 256)).shape == (7, 128)
        q = ops.rope_and_write_kv(*rope_inputs("cpu", num_tokens=3))
        assert q.shape == (3, 4, 16)
        attn = ops.paged_decode_attention(*decode_inputs("cpu"), 12, 0.25)
        assert attn.shape == (2, 4, 16)


def test_compile_traces_around_the_ops_without_a_graph_break(device):
    """A norm + gated MLP block: the ops stay whole in one graph, the matmuls around them
    are the compiler's; the output equals the eager one."""
    w_norm = torch.randn(32, device=device)
    w_up = torch.randn(32, 128, device=device) / 8
    w_down = torch.randn(64, 32, device=device) / 8

    def block(x, residual):
        h, residual = ops.fused_add_rms_norm(x, residual, w_norm, 1e-6)
        return ops.silu_and_mul(h @ w_up) @ w_down, residual

    x, r = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    explanation = torch._dynamo.explain(block)(x, r)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x, r), block(x, r)):
        torch.testing.assert_close(got, want)
