"""The exact 4-bit path (quantization="gguf_int4") on Q4_0/Q4_1 blocks of random bytes with
nonzero scales and mins of widely different sizes: torch's int4 kernel with float32 scales,
zeros and activations equals gguf's own dequantize followed by a float64 product within 1e-5
per matmul, for 1, 7 and 32 rows. The one rounding the repack adds is Q4_1's zero m + 8d in
float32 (torch's w = (q - 8) * scale + zero); bounded here by 2^-23 (16|d| + |m|) a weight."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tllm.layers.linear import Linear
from tllm.layers.quant.gguf import GgufLinearMethod
from tllm.layers.quant.gguf_blocks import block_shape, dequantize_blocks

pytest.importorskip("gguf")
IN, OUT = 256, 48


def random_blocks(qtype: str, seed: int) -> torch.Tensor:
    """Random nibbles; fp16 d (and Q4_1's m, either sign) nonzero, spread over 2^-20..2^1 so
    that m + 8d often needs more than float32's 24 bits."""
    rng = np.random.default_rng(seed)
    values, nbytes = block_shape(qtype)
    shape = (OUT, IN // values)
    raw = rng.integers(0, 256, (*shape, nbytes), dtype=np.uint8)

    def fp16(sign: bool) -> np.ndarray:
        size = rng.uniform(0.5, 2.0, shape) * 2.0 ** rng.integers(-20, 0, shape)
        return ((rng.choice([-1, 1], shape) if sign else 1) * size).astype(np.float16)

    raw[..., 0:2] = fp16(False).view(np.uint8).reshape(*shape, 2)
    if qtype == "Q4_1":
        raw[..., 2:4] = fp16(True).view(np.uint8).reshape(*shape, 2)
    return torch.from_numpy(raw)


def exact_layer(qtype: str, raw: torch.Tensor) -> Linear:
    layer = Linear(IN, OUT, quant=GgufLinearMethod(qtype, "int4", torch.float32))
    layer.load_weight("weight", raw)
    layer.quant.process_after_loading(layer)
    assert layer.quant.form == "int4"
    return layer


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_exact_product_matches_dequantized_reference(qtype, rows):
    raw = random_blocks(qtype, seed=rows)
    ref_w = dequantize_blocks(raw, qtype).double()
    assert (ref_w.view(OUT, -1, 32).abs().amax(-1) > 0).all()  # no all-zero block
    x = torch.randn(rows, IN)
    out = exact_layer(qtype, raw)(x).double()
    ref = x.double() @ ref_w.t()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    per_row = (out - ref).norm(dim=1) / ref.norm(dim=1)
    assert per_row.max().item() < 1e-5


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_weight_error_is_the_float32_zero_rounding(qtype):
    """Q4_0 (zero 0) is bit for bit; Q4_1 within 2^-23 (16|d| + |m|) (measured 1.4 ulp)."""
    raw = random_blocks(qtype, seed=3)
    layer = exact_layer(qtype, raw)
    got, ref = layer.quant.dequantized_weight(layer), dequantize_blocks(raw, qtype)
    if qtype == "Q4_0":
        assert torch.equal(got, ref)
        return
    d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    m = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    bound = (2.0 ** -23 * (16 * d.abs() + m.abs())).repeat_interleave(32, dim=1)
    assert ((got - ref).abs() <= bound).all()
