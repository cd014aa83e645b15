"""The Triton attention backend against the torch backend on the same step."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention import get_attention_backend  # noqa: E402
from tllm.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def run_both(device, query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, dtype,
             sliding_window=None, logits_soft_cap=None):
    batch = make_paged_batch(query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, 16,
                             dtype, device)
    scale = head_dim ** -0.5
    caches = {}
    outs = {}
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)(num_heads, num_kv_heads, head_dim, scale,
                                              sliding_window, logits_soft_cap=logits_soft_cap)
        caches[name] = tuple(c.clone() for c in batch.kv_cache)
        outs[name] = backend.forward(batch.q, batch.k, batch.v, caches[name], batch.metadata)
    return outs, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_with_cached_prefix(device, dtype):
    # a fresh prefill, a chunk after a cached prefix, and two decodes
    outs, caches = run_both(device, [40, 24, 1, 1], [0, 37, 90, 5], 8, 2, 64, dtype)
    assert outs["triton"].shape == outs["torch"].shape
    assert relative_error(outs["triton"], outs["torch"].float()) < TOL[dtype]
    for ours, theirs in zip(caches["triton"], caches["torch"]):
        assert torch.equal(ours, theirs)  # same dtype: the cache write is an exact copy


@pytest.mark.parametrize("window, cap", [(None, None), (16, 1.0)])
def test_mixed_step_with_leading_decodes(device, window, cap):
    # three decodes first (the decode kernel), then a prefill, a decode and a chunk (the
    # context kernel, its query starts counted from row 3)
    query_lens, prefix_lens = [1, 1, 1, 12, 1, 20], [70, 3, 40, 0, 33, 50]
    outs, caches = run_both(device, query_lens, prefix_lens, 4, 2, 64, torch.float32,
                            sliding_window=window, logits_soft_cap=cap)
    assert relative_error(outs["triton"], outs["torch"]) < 1e-5
    for ours, theirs in zip(caches["triton"], caches["torch"]):
        assert torch.equal(ours, theirs)


def test_decode_prefix_of_a_step(device):
    batch = make_paged_batch([1, 1, 12, 1], [5, 9, 0, 3], 2, 1, 16, 16, torch.float32, device)
    split = batch.metadata.decode_prefix()
    assert (split.num_seqs, split.max_seq_len, split.rest_max_query_len) == (2, 10, 12)
    assert split.rest_query_start_loc.tolist() == [0, 12, 13]
    assert batch.metadata.decode_prefix() is split  # once a step
    for lens in ([1, 1], [12, 1], [3]):  # all decodes, none first, one request
        meta = make_paged_batch(lens, [4] * len(lens), 2, 1, 16, 16, torch.float32,
                                device).metadata
        assert meta.decode_prefix() is None


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_decode_only_step(device, num_kv_heads):
    outs, _ = run_both(device, [1, 1, 1], [300, 0, 64], 4, num_kv_heads, 128, torch.float32)
    assert relative_error(outs["triton"], outs["torch"]) < 1e-5


@pytest.mark.parametrize("query_lens", [[5, 1], [1, 1]])
def test_tiny_head_dim(device, query_lens):
    # head dims under tl.dot's minimum of 16 are padded (tiny test models use 8)
    outs, _ = run_both(device, query_lens, [9, 30], 2, 1, 8, torch.float32)
    assert relative_error(outs["triton"], outs["torch"]) < 1e-5


def test_sliding_window(device):
    outs, _ = run_both(device, [20, 1], [50, 70], 4, 2, 64, torch.float32, sliding_window=16)
    assert relative_error(outs["triton"], outs["torch"]) < 1e-5


@pytest.mark.parametrize("query_lens", [[20, 1], [1, 1]])
def test_logits_soft_cap(device, query_lens):
    # the context kernel (a chunk beside a decode) and the decode kernel, windowed
    outs, _ = run_both(device, query_lens, [50, 70], 4, 2, 64, torch.float32,
                       sliding_window=16, logits_soft_cap=1.0)
    assert relative_error(outs["triton"], outs["torch"]) < 1e-5


def test_rejects_bad_shapes():
    cls = get_attention_backend("triton")
    with pytest.raises(ValueError, match="multiple"):
        cls(6, 4, 64, 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        cls(4, 4, 512, 0.125)
    assert cls is not TorchAttentionBackend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts GPU compiles")
def test_steps_of_new_shapes_compile_no_attention_kernel(monkeypatch):
    """Request counts, block-table widths and the request offset of a mixed step's prefills
    change every step; none of them may trigger a Triton compile once each tile choice was
    compiled (a compile mid-serving stalls the whole batch for 1-2 s)."""
    from triton import knobs
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: compiled.append(str(kw.get("repr"))))

    def step(query_lens, prefix_lens):
        run_both("cuda", query_lens, prefix_lens, 8, 2, 64, torch.bfloat16)

    step([1, 1, 1, 40], [200, 5, 60, 0])            # each kernel's first compile
    step([1] * 17 + [40], [300] * 17 + [0])        # split decodes: <= 16 partitions
    step([1, 40], [8000, 0])                        # > 16 partitions (the other merge tile)
    compiled.clear()
    for decodes, prefix in ((1, 3), (2, 700), (4, 16), (5, 1000), (16, 33), (31, 250)):
        step([1] * decodes + [40, 24], [prefix] * decodes + [0, prefix])
    attention = [c for c in compiled if "attention" in c or "merge" in c]
    assert not attention, attention
