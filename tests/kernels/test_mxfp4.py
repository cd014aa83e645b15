"""The MXFP4 decoder bit for bit against transformers' own, and the round trip through our
test quantizer."""
import pytest
import torch

from tllm.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_is_bit_exact_against_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    # [experts, rows, groups, 16]: every code, and scales across the whole E8M0 range but
    # 255 (2^128: inf in both), so subnormal and underflowing blocks are in too
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 8, 4), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)              # [E, rows, K]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert ours.dtype == theirs.dtype == dtype
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # inf and -0.0 alike
    assert torch.equal(ours.view(bits), theirs.contiguous().view(bits))


def test_quantize_round_trip_keeps_representable_values():
    g = torch.Generator().manual_seed(1)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    signs = torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    weight = codes[torch.randint(0, 8, (4, 64), generator=g)] * signs
    weight[:, ::32] = 6.0  # each block's peak is 6: scale 2^0
    weight = weight * torch.tensor([1.0, 0.25, 8.0, 2.0 ** -10])[:, None]
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (4, 2, 16) and scales.shape == (4, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), weight)


def test_layout_is_checked():
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="16"):
        dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
