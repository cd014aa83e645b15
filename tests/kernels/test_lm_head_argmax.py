"""The LM head GEMV with the argmax in its epilogue vs the unfused reference (logits rounded
to the logits dtype, then torch.argmax): vocabularies and hidden sizes off the tile sizes,
several rows, exact ties going to the lowest id."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.kernels.triton.lm_head_argmax import lm_head_argmax, lm_head_argmax_ref  # noqa: E402


def logits_of(hidden, weight, dtype):
    return (hidden.float() @ weight.float().T).to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab,hidden_size", [(1, 1000, 96), (3, 517, 300), (2, 64, 32)])
def test_equals_the_unfused_argmax(device, dtype, rows, vocab, hidden_size):
    hidden = torch.randn(rows, hidden_size, device=device).to(dtype)
    weight = torch.randn(vocab, hidden_size, device=device).to(dtype)
    got = lm_head_argmax(hidden, weight, block_v=64, block_k=128)
    want = lm_head_argmax_ref(hidden, weight)
    assert got.dtype == torch.long and got.shape == (rows,)
    if dtype == torch.float32 or device.type == "cuda":
        assert torch.equal(got.cpu(), want.cpu())
    else:  # the interpreter truncates fp32 -> bf16 instead of rounding: one ulp apart
        logits = logits_of(hidden, weight, torch.float32)
        chosen = logits.gather(1, got[:, None]).squeeze(1)
        assert torch.all(chosen >= logits.max(dim=1).values * (1 - 2 ** -7) - 1e-6)


def test_ties_go_to_the_lowest_token_id(device):
    hidden = torch.randn(2, 64, device=device)
    weight = torch.randn(300, 64, device=device)
    best = (hidden[0] @ weight.T).argmax()
    weight[[7, 150, 299]] = weight[best].clone()    # across tiles and within one
    weight[5] = -weight[best].clone()
    got = lm_head_argmax(hidden[:1], weight, block_v=64, block_k=64)
    assert got.tolist() == [min(7, int(best))]


def test_bad_shapes_are_refused(device):
    with pytest.raises(ValueError, match="hidden \\[M, K\\] and weight \\[V, K\\]"):
        lm_head_argmax(torch.randn(2, 8, device=device), torch.randn(5, 9, device=device))
