"""FP8 experts (tllm.layers.quant.fp8_moe) in a FusedMoE: each weight scheme's parameters, its
per-expert checkpoint tensors (quantized here by the formats' own formulas) loading whole and
sliced for two tensor-parallel ranks, quantization at load from 16/32-bit weights, and the
layer's output against the dequantized reference. Models: tests/models/test_fp8_moe_models.py."""
from __future__ import annotations

import pytest
import torch

from tllm.distributed import comm
from tllm.distributed.mapping import Mapping
from tllm.kernels import moe
from tllm.layers.moe import UNQUANTIZED_MOE, W2, W13, FusedMoE, select_experts
from tllm.layers.quant.fp8 import Fp8Config, Fp8Scheme
from tllm.layers.quant.fp8_moe import Fp8MoEMethod

FP8 = torch.float8_e4m3fn
E, H, I, TOP_K = 4, 48, 32, 2
BLOCK = (16, 16)
SCHEMES = {"tensor": Fp8Scheme("tensor"), "channel": Fp8Scheme("channel"),
           "block": Fp8Scheme("block", BLOCK), "online": Fp8Scheme(checkpoint_is_fp8=False)}


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The checkpoint's (fp8 weight, scale): amax / 448 per tensor (a 0-d scale), per row
    ([N, 1]) or per 16x16 block ([N/16, K/16]); "online" keeps the float weight."""
    if kind == "online":
        return w, None
    if kind == "tensor":
        scale = w.abs().amax() / 448
    elif kind == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
    else:
        n, k = w.shape
        scale = w.reshape(n // 16, 16, k // 16, 16).abs().amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
        return (w / full).clamp(-448, 448).to(FP8), scale
    return (w / scale).clamp(-448, 448).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return q.float()
    if scale.dim() == 2 and scale.shape[1] > 1:  # blocks
        return q.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
    return q.float() * scale


def checkpoint(kind: str, seed: int = 0) -> dict:
    """(param, expert, shard) -> (weight, scale) of every expert's gate, up and down."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[W13, e, 0] = quantize(torch.randn(I, H, generator=g) / H ** 0.5, kind)
        out[W13, e, 1] = quantize(torch.randn(I, H, generator=g) / H ** 0.5, kind)
        out[W2, e, None] = quantize(torch.randn(H, I, generator=g) / I ** 0.5, kind)
    return out


def build(monkeypatch, kind: str, mapping: Mapping = Mapping()) -> FusedMoE:
    monkeypatch.setattr(comm, "mapping", lambda: mapping)
    layer = FusedMoE(E, H, I, Fp8Config(SCHEMES[kind]), "layers.0.mlp.experts")
    scale_name = "_scale_inv" if kind == "block" else "_scale"
    loaded = set()
    for (param, e, shard), (weight, scale) in checkpoint(kind).items():
        loaded |= layer.load_expert(param, e, shard, weight)
        if scale is not None:
            loaded |= layer.load_expert(param + scale_name, e, shard, scale)
    assert loaded == layer.expected_keys()
    layer.process_after_loading()
    return layer


def dequantized_reference(kind: str, x, weights, ids) -> torch.Tensor:
    """fused_experts_ref on the checkpoint's weights as its format dequantizes them (a
    16/32-bit one: as it dequantizes once quantized per channel at load)."""
    tensors = {key: dequantize(*(quantize(w, "channel") if kind == "online" else (w, s)))
               for key, (w, s) in checkpoint(kind).items()}
    w13 = torch.stack([torch.cat([tensors[W13, e, 0], tensors[W13, e, 1]]) for e in range(E)])
    w2 = torch.stack([tensors[W2, e, None] for e in range(E)])
    return moe.fused_experts_ref(x, w13, w2, weights, ids)


@pytest.mark.parametrize("kind", list(SCHEMES))
def test_layer_against_dequantized_reference(monkeypatch, kind):
    layer = build(monkeypatch, kind)
    assert isinstance(layer.quant, Fp8MoEMethod)
    assert layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
    x = torch.randn(13, H)
    weights, ids = select_experts(torch.randn(13, E), TOP_K, True)
    got = layer(x, weights, ids)
    want = dequantized_reference(kind, x, weights, ids)
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 0.08  # activations quantized per token (~4.5%): never exact


def test_per_tensor_scales_spread_over_their_rows(monkeypatch):
    """Gate and up keep their own per-tensor scale: the reconciled per-row form."""
    layer = build(monkeypatch, "tensor")
    tensors = checkpoint("tensor")
    for e in range(E):
        scale = layer.w13_weight_scale[e, :, 0]
        assert torch.equal(scale[:I], tensors[W13, e, 0][1].float().expand(I))
        assert torch.equal(scale[I:], tensors[W13, e, 1][1].float().expand(I))
        assert torch.equal(layer.w2_weight_scale[e, :, 0], tensors[W2, e, None][1].expand(H))


@pytest.mark.parametrize("kind", ["block", "channel", "online"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_sum_to_the_whole(monkeypatch, kind, expert_parallel):
    """Two ranks' halves of every expert (block scales sliced on whole blocks; each rank
    quantizes its own slice of the intermediate, so up to fp8's rounding), or half the
    experts whole each (exact), add up to one rank's output."""
    x = torch.randn(11, H)
    weights, ids = select_experts(torch.randn(11, E), TOP_K, True)
    whole = build(monkeypatch, kind)(x, weights, ids)
    parts = [build(monkeypatch, kind, Mapping(2, 2, 1, rank, expert_parallel))(x, weights, ids)
             for rank in range(2)]
    tol = 1e-6 if expert_parallel else 0.03
    assert float((parts[0] + parts[1] - whole).norm() / whole.norm()) < tol


def test_config_picks_the_method_and_ignores():
    config = Fp8Config(Fp8Scheme("block", BLOCK), ignore=("re:.*layers\\.1\\.mlp.*",))
    assert isinstance(config.moe_method("layers.0.mlp.experts"), Fp8MoEMethod)
    assert config.moe_method("layers.1.mlp.experts") is UNQUANTIZED_MOE


def test_block_scales_need_whole_blocks(monkeypatch):
    monkeypatch.setattr(comm, "mapping", lambda: Mapping())
    with pytest.raises(ValueError, match="multiple of the weight block"):
        FusedMoE(E, H, 24, Fp8Config(Fp8Scheme("block", BLOCK)))
    with pytest.raises(ValueError, match="has shape"):
        layer = FusedMoE(E, H, I, Fp8Config(Fp8Scheme("block", BLOCK)))
        layer.load_expert(W13 + "_scale_inv", 0, 0, torch.ones(3, 3))


@pytest.mark.parametrize("kind", ["online", "block"])
def test_dummy_weights_quantized_one_expert_at_a_time(monkeypatch, kind):
    """dummy: presets: the method fills its fp8 weights and scales (fp8 has no normal_)."""
    from tllm.loader.dummy import init_dummy_weights
    monkeypatch.setattr(comm, "mapping", lambda: Mapping())
    model = torch.nn.Module()
    model.experts = FusedMoE(E, H, I, Fp8Config(SCHEMES[kind]))
    init_dummy_weights(model, seed=1)
    layer = model.experts
    experts = layer.quant.experts(layer)
    for expert in range(E):
        w13, w2 = experts.dequantized(expert)
        assert 0.01 < float(w13.std()) < 0.03 and 0.01 < float(w2.std()) < 0.03
    x = torch.randn(5, H)
    weights, ids = select_experts(torch.randn(5, E), TOP_K, True)
    assert layer(x, weights, ids).isfinite().all()
