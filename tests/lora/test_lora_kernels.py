"""The batched LoRA kernels (shrink, expand) against the torch references, on fresh random
inputs with a mix of adapters and tokens without one (-1)."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.lora import (lora_bmm_ref, lora_expand_ref,  # noqa: E402
                               lora_shrink_ref)
from tllm.kernels.triton.lora import lora_expand, lora_shrink  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_case(num_tokens, in_features, slice_sizes, rank, num_slots, dtype, device,
                seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(slice_sizes)
    out_features = sum(slice_sizes)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype).to(device)
    a = (torch.randn(num_slots, num_slices * rank, in_features, generator=gen) * 0.1)
    b = (torch.randn(num_slots, out_features, rank, generator=gen) * 0.1)
    indices = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    bounds = [0]
    for size in slice_sizes:
        bounds.append(bounds[-1] + size)
    return (x, a.to(dtype).to(device), b.to(dtype).to(device), indices.to(device),
            tuple(bounds))


CASES = [  # tokens, in, slices, rank, slots
    (1, 64, (32,), 8, 1),
    (7, 96, (64, 16, 16), 16, 3),      # qkv-like, rank below the dot minimum of 16
    (37, 128, (80, 80), 16, 4),        # gate/up-like; a slice boundary inside a tile
    (20, 48, (40,), 32, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,in_features,slices,rank,num_slots", CASES)
def test_shrink_and_expand_match_the_reference(device, dtype, num_tokens, in_features, slices,
                                               rank, num_slots):
    x, a, b, indices, bounds = random_case(num_tokens, in_features, slices, rank, num_slots,
                                           dtype, device)
    h = lora_shrink(x, a, indices)
    h_ref = lora_shrink_ref(x.double(), a.double(), indices)
    assert h.dtype == torch.float32 and not h.isnan().any()
    assert relative_error(h, h_ref.float()) < TOL[dtype]
    assert torch.all(h[indices < 0] == 0)

    base = torch.randn(num_tokens, sum(slices)).to(dtype).to(device)
    out = lora_expand(base.clone(), h_ref.float(), b, indices,
                      torch.tensor(bounds, dtype=torch.int32, device=device), len(slices))
    want = lora_expand_ref(base.double(), h_ref, b.double(), indices, bounds)
    assert not out.isnan().any()
    assert relative_error(out, want.to(dtype)) < TOL[dtype]
    # rows without an adapter are left exactly as they were
    assert torch.equal(out[indices < 0], base[indices < 0])


def test_every_token_without_an_adapter_changes_nothing(device):
    x, a, b, _, bounds = random_case(9, 64, (32, 32), 16, 2, torch.float32, device)
    indices = torch.full((9,), -1, dtype=torch.int32, device=device)
    base = torch.randn(9, 64, device=device)
    h = lora_shrink(x, a, indices)
    out = lora_expand(base.clone(), h, b, indices,
                      torch.tensor(bounds, dtype=torch.int32, device=device), 2)
    assert torch.equal(out, base)


def test_bmm_reference_equals_the_grouped_one():
    x, a, b, indices, bounds = random_case(11, 32, (16, 8, 8), 8, 3, torch.float64,
                                           torch.device("cpu"))
    base = torch.randn(11, 32, dtype=torch.float64)
    grouped = lora_expand_ref(base.clone(), lora_shrink_ref(x, a, indices), b, indices, bounds)
    assert torch.allclose(lora_bmm_ref(base, x, a, b, indices, bounds), grouped)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_shrink_split_over_k_sums_the_partials(device, num_splits):
    x, a, _, indices, _ = random_case(18, 200, (32, 32), 16, 3, torch.float32, device, seed=3)
    h = lora_shrink(x, a, indices, num_splits=num_splits)
    assert relative_error(h, lora_shrink_ref(x.double(), a.double(), indices).float()) < 1e-5
