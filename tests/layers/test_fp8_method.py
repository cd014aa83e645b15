"""The FP8 linear method on its own: the parameters each scheme registers, per-shard scales of
merged layers, each rank's slice of block scales, the run-time forms after loading, the
product against an independent emulation, quantize-at-load, and Fp8Config's ignore lists."""
from __future__ import annotations

import pytest
import torch

from tllm.distributed import comm
from tllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from tllm.layers.quant import UnquantizedMethod
from tllm.layers.quant.fp8 import Fp8Config, Fp8LinearMethod, Fp8Scheme

FP8 = torch.float8_e4m3fn


def fp8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(FP8)


def scales(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) * 0.01 + 1e-3


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def per_token(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    rows = x.reshape(-1, group) if group else x
    scale = (rows.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return fake_quant(rows, scale).reshape(x.shape)


@pytest.mark.parametrize("scheme,expected", [
    (Fp8Scheme("channel"), {"weight": ((48, 32), FP8), "weight_scale": ((48, 1), torch.float32)}),
    (Fp8Scheme("tensor", activation="static"),
     {"weight": ((48, 32), FP8), "weight_scale": ((2,), torch.float32),
      "input_scale": ((2,), torch.float32)}),
    (Fp8Scheme("block", block=(16, 16)),
     {"weight": ((48, 32), FP8), "weight_scale_inv": ((3, 2), torch.float32)}),
])
def test_registered_parameters(scheme, expected):
    layer = MergedLinear(32, [16, 32], quant=Fp8LinearMethod(scheme))
    got = {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()}
    assert got == expected


def test_block_scales_with_static_activations_refused():
    with pytest.raises(ValueError, match="dynamic activations only"):
        Fp8LinearMethod(Fp8Scheme("block", activation="static"))


def test_per_tensor_shards_of_a_merged_layer():
    """q/k/v each bring one weight scale and one input scale: the scales spread over their
    rows, the shards share the largest input scale."""
    layer = QKVLinear(32, 8, num_heads=4, num_kv_heads=2,
                      quant=Fp8LinearMethod(Fp8Scheme("tensor", activation="static")))
    shards = [fp8_weight(rows, 32, seed=i) for i, rows in enumerate((32, 16, 16))]
    w_scales = [torch.tensor(s) for s in (0.01, 0.02, 0.03)]
    in_scales = [torch.tensor(s) for s in (0.05, 0.07, 0.06)]
    for i in range(3):
        layer.load_shard("weight", i, shards[i])
        layer.load_shard("weight_scale", i, w_scales[i])
        layer.load_shard("input_scale", i, in_scales[i].reshape(1))  # [1] as llm-compressor
    layer.quant.process_after_loading(layer)
    expected = torch.cat([q.float() * s for q, s in zip(shards, w_scales)])
    assert torch.equal(layer.quant.dequantized_weight(layer), expected)
    assert layer.weight_scale.shape == (64, 1)
    assert layer.input_scale.item() == pytest.approx(0.07)
    x = torch.randn(5, 32)
    ref = fake_quant(x, torch.tensor(0.07)) @ expected.t()
    assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", [Fp8Scheme("channel"), Fp8Scheme("tensor"),
                                    Fp8Scheme("block", block=(16, 16))],
                         ids=["channel", "tensor", "block"])
def test_product_equals_emulation(scheme):
    """fp8 weights, activations quantized per token (per token and 16 columns for block
    scales), fp32 accumulation: equal to fake-quantized fp32 inputs times the dequantized
    weight, up to fp32 summation order."""
    layer = RowParallelLinear(64, 48, quant=Fp8LinearMethod(scheme))
    layer.load_weight("weight", fp8_weight(48, 64, seed=1))
    if scheme.weight == "channel":
        layer.load_weight("weight_scale", scales(48, 1, seed=2))
    elif scheme.weight == "tensor":
        layer.load_weight("weight_scale", scales(1, seed=2)[0])
    else:
        layer.load_weight("weight_scale_inv", scales(3, 4, seed=2))
    layer.quant.process_after_loading(layer)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    group = 16 if scheme.weight == "block" else None
    ref = per_token(x, group) @ layer.quant.dequantized_weight(layer).t()
    out = layer(x)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-6


def test_each_rank_takes_its_block_scales(monkeypatch):
    """Rank 1 of 2: its kv head's rows of k and v, its half of o_proj's input columns, and
    the same rows and columns of the block scales."""
    monkeypatch.setattr(comm, "tp_rank_and_size", lambda: (1, 2))
    method = Fp8LinearMethod(Fp8Scheme("block", block=(16, 16)))
    qkv = QKVLinear(64, 16, num_heads=4, num_kv_heads=2, quant=method)
    full_q, full_k = fp8_weight(64, 64, seed=1), fp8_weight(32, 64, seed=2)
    q_scale, k_scale = scales(4, 4, seed=3), scales(2, 4, seed=4)
    qkv.load_shard("weight", 0, full_q)
    qkv.load_shard("weight_scale_inv", 0, q_scale)
    qkv.load_shard("weight", 1, full_k)
    qkv.load_shard("weight_scale_inv", 1, k_scale)
    assert torch.equal(qkv.weight_scale_inv[:2], q_scale[2:])   # q rows 32..63
    assert torch.equal(qkv.weight_scale_inv[2:3], k_scale[1:])  # kv head 1: rows 16..31
    assert torch.equal(qkv.weight[32:48].float(), full_k[16:].float())
    o_proj = RowParallelLinear(64, 32, quant=method)
    o_scale = scales(2, 4, seed=5)
    o_proj.load_weight("weight_scale_inv", o_scale)
    assert torch.equal(o_proj.weight_scale_inv, o_scale[:, 2:])  # input columns 32..63


def test_shard_off_block_boundaries_refused(monkeypatch):
    monkeypatch.setattr(comm, "tp_rank_and_size", lambda: (1, 2))
    layer = MergedLinear(32, [48, 48], quant=Fp8LinearMethod(Fp8Scheme("block",
                                                                        block=(16, 16))))
    with pytest.raises(ValueError, match="whole blocks of 16 rows"):
        layer.load_shard("weight_scale_inv", 0, scales(3, 2, seed=1))  # 24 rows per rank


def test_quantize_at_load():
    """checkpoint_is_fp8=False: the checkpoint's fp32 weight, fp8 with a scale per row once
    loaded; each element within e4m3's half step (2^-4 relative, 2^-9 x scale near zero)."""
    layer = RowParallelLinear(64, 32, quant=Fp8LinearMethod(Fp8Scheme(checkpoint_is_fp8=False)))
    w = torch.randn(32, 64)
    layer.load_weight("weight", w)
    layer.quant.process_after_loading(layer)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (32, 1)
    error = (layer.quant.dequantized_weight(layer) - w).abs()
    assert (error <= w.abs() * 2 ** -4 + layer.weight_scale * 2 ** -9).all()


def test_ignore_list_and_merged_shards():
    config = Fp8Config(ignore=("re:model\\.layers\\.0\\..*", "model.layers.1.self_attn.k_proj",
                               "gate_proj"))
    assert isinstance(config.linear_method("layers.0.mlp.down_proj"), UnquantizedMethod)
    # one ignored projection of a merged layer leaves all of it in the model's dtype
    assert isinstance(config.linear_method("layers.1.self_attn.qkv_proj",
                                           ("q_proj", "k_proj", "v_proj")), UnquantizedMethod)
    assert isinstance(config.linear_method("layers.5.mlp.gate_up_proj",
                                           ("gate_proj", "up_proj")), UnquantizedMethod)
    assert isinstance(config.linear_method("layers.1.self_attn.o_proj"), Fp8LinearMethod)
    assert isinstance(config.linear_method("layers.10.mlp.down_proj"), Fp8LinearMethod)
