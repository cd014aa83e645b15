"""The batched LoRA kernels (shrink, expand) against the torch references, on fresh random
inputs with a mix of adapters and tokens without one (-1), through the step's token grouping
(`LoraBatch`) that every layer shares."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.lora import lora_bmm_ref, lora_expand_ref, lora_shrink_ref  # noqa: E402
from tllm.kernels.lora_batch import (LORA_BLOCK_T, LoraBatch, LoraKernelConfig,  # noqa: E402
                                     group_tokens)
from tllm.kernels.triton.lora import lora_expand, lora_shrink  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_case(num_tokens, in_features, slice_sizes, rank, num_slots, dtype, device,
                seed=0, runs=False):
    """x, A, B, per-token slots (host) and bounds. `runs`: slots come in request-like runs
    (a prefill's tokens share one), else each token draws its own."""
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(slice_sizes)
    out_features = sum(slice_sizes)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype).to(device)
    a = (torch.randn(num_slots, num_slices * rank, in_features, generator=gen) * 0.1)
    b = (torch.randn(num_slots, out_features, rank, generator=gen) * 0.1)
    if runs:
        lengths = torch.randint(1, 24, (num_tokens,), generator=gen)
        per_run = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
        indices = per_run.repeat_interleave(lengths)[:num_tokens]
    else:
        indices = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    bounds = [0]
    for size in slice_sizes:
        bounds.append(bounds[-1] + size)
    return (x, a.to(dtype).to(device), b.to(dtype).to(device), indices, tuple(bounds))


def make_batch(indices, num_slots, device, max_tokens=None) -> LoraBatch:
    batch = LoraBatch(max_tokens or indices.shape[0], num_slots, device)
    batch.fill(indices)
    return batch


CASES = [  # tokens, in, slices, rank, slots, request-like runs
    (1, 64, (32,), 8, 1, False),
    (7, 96, (64, 16, 16), 16, 3, False),      # qkv-like, rank below the dot minimum of 16
    (37, 128, (80, 80), 16, 4, False),        # gate/up-like; a slice boundary in a block
    (53, 64, (48, 16), 16, 3, True),          # prefill-like runs: tiles of 16 of one slot
    (20, 48, (40,), 32, 2, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,in_features,slices,rank,num_slots,runs", CASES)
def test_shrink_and_expand_match_the_reference(device, dtype, num_tokens, in_features, slices,
                                               rank, num_slots, runs):
    x, a, b, indices, bounds = random_case(num_tokens, in_features, slices, rank, num_slots,
                                           dtype, device, runs=runs)
    batch = make_batch(indices, num_slots, device, max_tokens=num_tokens + 5)
    has = indices >= 0
    partial = lora_shrink(x, a, batch)
    h = partial.sum(0).cpu()
    h_ref = lora_shrink_ref(x.double(), a.double(), indices.to(device)).cpu()
    assert partial.dtype == torch.float32 and not h[has].isnan().any()
    assert relative_error(h[has], h_ref[has].float()) < TOL[dtype]

    base = torch.randn(num_tokens, sum(slices)).to(dtype).to(device)
    out = lora_expand(base.clone(), h_ref.float().to(device)[None], b, batch, bounds)
    want = lora_expand_ref(base.double(), h_ref.to(device), b.double(), indices.to(device),
                           bounds)
    assert not out.isnan().any()
    assert relative_error(out, want.to(dtype)) < TOL[dtype]
    # rows without an adapter are left exactly as they were
    assert torch.equal(out[~has.to(device)], base[~has.to(device)])
    # the expand sums the shrink's K partials itself
    fused = lora_expand(base.clone(), partial, b, batch, bounds)
    assert relative_error(fused, want.to(dtype)) < TOL[dtype]


def test_every_token_without_an_adapter_changes_nothing(device):
    x, a, b, _, bounds = random_case(9, 64, (32, 32), 16, 2, torch.float32, device)
    indices = torch.full((9,), -1, dtype=torch.int32)
    batch = make_batch(indices, 2, device)
    assert not batch.has_adapters
    base = torch.randn(9, 64, device=device)
    out = lora_expand(base.clone(), lora_shrink(x, a, batch), b, batch, bounds)
    assert torch.equal(out, base)


def test_a_later_step_reuses_the_buffers(device):
    """Static buffers refilled by a smaller step (as before a graph replay with padding
    rows): the old step's tiles and tokens leave no trace."""
    x, a, b, indices, bounds = random_case(40, 32, (16, 16), 8, 3, torch.float32, device,
                                           seed=5, runs=True)
    batch = make_batch(indices, 3, device, max_tokens=64)
    small = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32)
    batch.fill(small)
    rows = 8  # 3 padding rows past the step's 5 tokens, as a captured batch size brings
    base = torch.randn(rows, 32, device=device)
    out = lora_expand(base.clone(), lora_shrink(x[:rows], a, batch), b, batch, bounds)
    padded = torch.cat([small, torch.full((3,), -1, dtype=torch.int32)]).to(device)
    want = lora_expand_ref(base.double(), lora_shrink_ref(x[:rows].double(), a.double(),
                                                          padded), b.double(), padded, bounds)
    assert relative_error(out, want.float()) < 1e-5
    assert torch.equal(out[5:], base[5:])


@pytest.mark.parametrize("seed", range(4))
def test_tiles_cover_each_token_once_within_the_graph_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, max_loras = int(torch.randint(1, 300, (1,), generator=gen)), 5
    indices = torch.randint(-1, max_loras, (num_tokens,), generator=gen, dtype=torch.int32)
    if seed % 2:
        indices = indices.sort().values  # long runs, as prefills bring
    batch = LoraBatch(num_tokens, max_loras, torch.device("cpu"))
    tile_slots, tile_tokens = group_tokens(indices, batch.max_tiles)
    tile_slots, tile_tokens = torch.from_numpy(tile_slots), torch.from_numpy(tile_tokens)
    num_used = int((tile_slots >= 0).sum())
    assert num_used == tile_tokens.shape[0] <= batch.tile_bound(num_tokens)
    assert torch.all(tile_slots[num_used:] == -1)  # used tiles first
    seen = []
    for slot, tokens in zip(tile_slots[:num_used].tolist(), tile_tokens):
        tokens = tokens[tokens >= 0].long()
        assert 1 <= tokens.shape[0] <= LORA_BLOCK_T
        assert torch.all(indices[tokens] == slot)
        seen += tokens.tolist()
    assert sorted(seen) == (indices >= 0).nonzero().squeeze(1).tolist()


def test_bmm_reference_equals_the_grouped_one():
    x, a, b, indices, bounds = random_case(11, 32, (16, 8, 8), 8, 3, torch.float64,
                                           torch.device("cpu"))
    base = torch.randn(11, 32, dtype=torch.float64)
    grouped = lora_expand_ref(base.clone(), lora_shrink_ref(x, a, indices), b, indices, bounds)
    assert torch.allclose(lora_bmm_ref(base, x, a, b, indices, bounds), grouped)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_partials_sum_to_h(device, num_splits):
    x, a, b, indices, bounds = random_case(18, 200, (32, 32), 16, 3, torch.float32, device,
                                           seed=3)
    batch = make_batch(indices, 3, device)
    config = LoraKernelConfig(shrink_block_k=32, expand_block_n=32)
    partial = lora_shrink(x, a, batch, num_splits=num_splits, config=config)
    assert partial.shape[0] == num_splits
    has = indices >= 0
    h_ref = lora_shrink_ref(x.double(), a.double(), indices.to(device)).cpu()
    assert relative_error(partial.sum(0).cpu()[has], h_ref[has].float()) < 1e-5
    base = torch.randn(18, 64, device=device)
    out = lora_expand(base.clone(), partial, b, batch, bounds, config=config)
    want = lora_expand_ref(base.double(), h_ref.to(device), b.double(), indices.to(device),
                           bounds)
    assert relative_error(out, want.float()) < 1e-5


def test_expand_refuses_bounds_it_cannot_take(device):
    _, _, b, indices, _ = random_case(4, 16, (8, 8), 8, 2, torch.float32, device)
    batch = make_batch(indices, 2, device)
    h = torch.zeros(1, 4, 16, device=device)
    with pytest.raises(ValueError, match="bounds"):
        lora_expand(torch.zeros(4, 16, device=device), h, b, batch, (0, 4, 8, 12, 16))


def test_step_slots_through_the_kernels(device):
    """A mixed step as the engine sets it (per request: adapter slot and query length)."""
    from tllm.lora.layers import TokenSlots
    slots = TokenSlots(max_tokens=64, max_loras=3, device=device)
    slots.set([2, -1, 0, 2, 1, 0], [20, 3, 1, 1, 5, 1])
    assert slots.is_active
    x, a, b, _, bounds = random_case(31, 48, (32, 16), 8, 3, torch.float32, device, seed=7)
    indices = slots.batch.indices[:31]
    base = torch.randn(31, 48, device=device)
    out = lora_expand(base.clone(), lora_shrink(x, a, slots.batch), b, slots.batch, bounds)
    want = lora_expand_ref(base.double(), lora_shrink_ref(x.double(), a.double(), indices),
                           b.double(), indices, bounds)
    assert relative_error(out, want.float()) < 1e-5
    slots.set([-1, -1], [1, 1])  # no adapter: the table is emptied once, then left alone
    assert not slots.is_active and not slots.batch.has_adapters
    assert torch.all(slots.batch.tile_slots == -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_read_each_steps_table():
    """One capture, replayed after the table changes (8 adapters, 1, none), as decode does."""
    device = torch.device("cuda")
    x, a, b, _, bounds = random_case(32, 256, (128, 64, 64), 16, 8, torch.bfloat16, device)
    batch = LoraBatch(64, 8, device)
    batch.fill(torch.arange(32, dtype=torch.int32) % 8)
    base = torch.randn(32, 256, device=device, dtype=torch.bfloat16)
    out = base.clone()
    for _ in range(2):  # compile outside the capture
        lora_expand(out, lora_shrink(x, a, batch), b, batch, bounds)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_expand(out, lora_shrink(x, a, batch), b, batch, bounds)
    for per_token in (torch.arange(32) % 8, torch.zeros(32), torch.full((32,), -1)):
        per_token = per_token.to(torch.int32)
        batch.fill(per_token)
        out.copy_(base)
        graph.replay()
        idx = per_token.to(device)
        want = lora_expand_ref(base.double(), lora_shrink_ref(x.double(), a.double(), idx),
                               b.double(), idx, bounds)
        assert relative_error(out, want) < 1e-2
