"""GGUF blocks kept quantized (tllm.layers.quant.gguf), checked against the `gguf` package's
own dequantize: the int4 repack of Q4_0/Q4_1/Q4_K is exact (torch's int4 kernel computes
(q - 8) * scale + zero; with float32 scales it reproduces gguf bit for bit), its bf16 form and
the int8 re-quantization of the other types stay within measured bounds, products against a
float64 reference, merged layers, tensor-parallel slices, the embedding and the LM head."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tllm.distributed import comm
from tllm.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from tllm.layers.quant import UNQUANTIZED, embedding_layer, lm_head_layer
from tllm.layers.quant.gguf import (GgufConfig, GgufEmbedding, GgufLinearMethod, GgufLMHead,
                                    block_shape, dequantize_blocks, int4_planes)

gguf = pytest.importorskip("gguf")
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")   # gguf-py quantizes these itself


def gguf_blocks(qtype: str, rows: int, cols: int, seed: int = 0):
    """(blocks [rows, blocks, bytes], the float weight they were made from or None). Types
    gguf-py can quantize are made from a random weight; K-quants from random bytes with the
    fp16 super-block scales set to a plausible size (random 6-bit sub-scales and mins)."""
    rng = np.random.default_rng(seed)
    values, nbytes = block_shape(qtype)
    if qtype in QUANTIZABLE:
        weight = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(data.reshape(rows, -1, nbytes).copy()), torch.from_numpy(weight)
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (rows, cols // values, 2)) * 1e-3).astype(np.float16)
    if qtype in ("Q6_K", "Q3_K"):            # the fp16 d comes last in these
        raw[..., nbytes - 2:] = scales[..., :1].view(np.uint8)
    else:                                    # d, dmin, then packed scales and values
        raw[..., 0:4] = scales.view(np.uint8).reshape(rows, cols // values, 4)
    return torch.from_numpy(raw), None


def reference(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    return dequantize_blocks(raw, qtype)


def loaded(layer, raw):
    layer.load_weight("weight", raw)
    layer.quant.process_after_loading(layer)
    return layer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_int4_repack_is_exact(qtype):
    """The planes, and the method's weight as torch's kernel unpacks it, equal gguf's
    dequantize bit for bit when scales and zeros are float32; bf16 rounds only them."""
    raw, _ = gguf_blocks(qtype, 64, 512, seed=1)
    ref = reference(raw, qtype)
    planes = int4_planes(raw, qtype)
    assert len(planes) == (2 if qtype == "Q8_0" else 1)
    assert torch.equal(sum((q.double() - 8).reshape(64, -1, 32) * s[..., None].double()
                           + z[..., None].double() for q, s, z in planes).float().reshape(64, 512),
                       ref)
    exact = loaded(Linear(512, 64, quant=GgufLinearMethod(qtype, "int4", torch.float32)), raw)
    assert torch.equal(exact.quant.dequantized_weight(exact), ref)
    fast = loaded(Linear(512, 64, quant=GgufLinearMethod(qtype, "int4")), raw)
    assert fast.qweight.dtype == torch.uint8 and fast.qweight.shape == (64, 256)
    assert fast.scales_zeros.shape == (16, 64, 2) and fast.scales_zeros.dtype == torch.bfloat16
    assert rel(fast.quant.dequantized_weight(fast), ref) < 3e-3  # measured 1.7e-3 (2^-9 scale)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_int4_product(qtype, tokens):
    raw, _ = gguf_blocks(qtype, 96, 256, seed=tokens)
    ref_w = reference(raw, qtype).double()
    x = torch.randn(tokens, 256)
    exact = loaded(Linear(256, 96, quant=GgufLinearMethod(qtype, "int4", torch.float32)), raw)
    assert rel(exact(x), x.double() @ ref_w.t()) < 1e-5
    fast = loaded(Linear(256, 96, quant=GgufLinearMethod(qtype, "int4")), raw)
    out = torch.full((tokens, 96), float("nan"))
    out[:] = fast(x)
    assert out.dtype == torch.float32
    assert rel(out, x.double() @ ref_w.t()) < 1e-2               # bf16 x, scales and output
    # against the weight the kernel holds, only bf16 x and output rounding remain
    seen = fast.quant.dequantized_weight(fast).double()
    assert rel(out, x.bfloat16().double() @ seen.t()) < 5e-3


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0",
                                   "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_int8_requantization_error(qtype):
    """The default CPU form: int8 per output channel. Measured for the 5/6-bit types (64 x
    512): ||w_int8 - w_gguf|| / ||w_gguf|| 0.73-0.82%, against the 3.8-4.3% Q5_0/Q5_1 lose on
    the same Gaussian weights; Q8_0 loses 0.54% itself and its int8 row adds 0.78% (exact
    int4 planes with quantization="gguf_int4")."""
    raw, original = gguf_blocks(qtype, 64, 512, seed=2)
    ref = reference(raw, qtype)
    layer = loaded(Linear(512, 64, quant=GgufLinearMethod(qtype, "int8")), raw)
    assert layer.qweight.dtype == torch.int8 and layer.scale.dtype == torch.bfloat16
    err = rel(layer.quant.dequantized_weight(layer), ref)
    assert err < 1.2e-2, err
    if original is not None and qtype != "Q8_0":  # well under the format's own loss
        assert err < 0.5 * rel(ref, original)
    x = torch.randn(9, 512)
    assert rel(layer(x), x.double() @ ref.double().t()) < 2e-2


def test_other_types_are_dense_at_load():
    raw, _ = gguf_blocks("Q3_K", 32, 256, seed=3)
    config = GgufConfig({"layers.0.mlp.down_proj.weight": "Q3_K"})
    assert config.dequantized_types() == {"Q3_K"}
    method = config.linear_method("layers.0.mlp.down_proj")
    layer = loaded(Linear(256, 32, quant=method), raw)
    assert torch.equal(layer.weight, reference(raw, "Q3_K"))


def test_merged_layers_and_mixed_types():
    """q/k/v in one type keep its blocks (each shard's rows land in place); a Q6_K v beside
    Q4_K q and k (Q4_K_M files) makes the merged layer int8 from the loader's float rows."""
    types = {f"layers.0.self_attn.{p}.weight": "Q4_K" for p in ("q_proj", "k_proj", "v_proj")}
    assert GgufConfig(types).linear_method(
        "layers.0.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")).form == "int8"
    config = GgufConfig(types, exact_int4=True)
    method = config.linear_method("layers.0.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))
    assert method.form == "int4" and config.keeps_blocks("layers.0.self_attn.k_proj.weight")
    layer = QKVLinear(256, 32, num_heads=4, num_kv_heads=2, quant=method)
    shards = [gguf_blocks("Q4_K", rows, 256, seed=i)[0] for i, rows in enumerate((128, 64, 64))]
    for i, shard in enumerate(shards):
        layer.load_shard("weight", i, shard)
    layer.quant.process_after_loading(layer)
    expected = torch.cat([reference(s, "Q4_K") for s in shards])
    x = torch.randn(3, 256)
    assert rel(layer(x), x.double() @ expected.double().t()) < 1e-2

    mixed = GgufConfig({**types, "layers.0.self_attn.v_proj.weight": "Q6_K"})
    assert not mixed.keeps_blocks("layers.0.self_attn.q_proj.weight")
    method = mixed.linear_method("layers.0.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))
    assert (method.qtype, method.form) == (None, "int8")
    assert GgufConfig(mixed.tensor_types, dequantize=True).linear_method(
        "layers.0.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")) is UNQUANTIZED
    layer = QKVLinear(256, 32, num_heads=4, num_kv_heads=2, quant=method)
    floats = [reference(s, "Q4_K") for s in shards]
    for i, shard in enumerate(floats):
        layer.load_shard("weight", i, shard)
    layer.quant.process_after_loading(layer)
    assert rel(layer.quant.dequantized_weight(layer), torch.cat(floats)) < 1e-2


def test_float_and_unknown_tensors_stay_unquantized():
    config = GgufConfig({"layers.0.mlp.down_proj.weight": "F16"})
    assert config.linear_method("layers.0.mlp.down_proj") is UNQUANTIZED
    assert config.linear_method("layers.0.mlp.gate_up_proj", ("gate_proj", "up_proj")) \
        is UNQUANTIZED
    assert not config.keeps_blocks("layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_tensor_parallel_slices(monkeypatch, qtype):
    """Row-parallel ranks take whole blocks of input features, merged column-parallel ranks
    their rows: each rank's weight is its slice of the full dequantized weight."""
    raw, _ = gguf_blocks(qtype, 64, 1024, seed=4)
    full = reference(raw, qtype)
    monkeypatch.setattr(comm, "tp_rank_and_size", lambda: (1, 2))
    row = loaded(RowParallelLinear(1024, 64, quant=GgufLinearMethod(qtype, "int4",
                                                                    torch.float32)), raw)
    assert torch.equal(row.quant.dequantized_weight(row), full[:, 512:])
    merged = MergedLinear(1024, [64, 64], quant=GgufLinearMethod(qtype, "int4", torch.float32))
    merged.load_shard("weight", 0, raw)
    merged.load_shard("weight", 1, raw)
    merged.quant.process_after_loading(merged)
    assert torch.equal(merged.quant.dequantized_weight(merged),
                       torch.cat([full[32:], full[32:]]))


def test_tensor_parallel_off_block_split_refused(monkeypatch):
    monkeypatch.setattr(comm, "tp_rank_and_size", lambda: (0, 2))
    with pytest.raises(ValueError, match="blocks of 256 input features"):
        RowParallelLinear(768, 64, quant=GgufLinearMethod("Q4_K", "int4"))  # 384 per rank


def test_tied_embedding_and_lm_head():
    """SmolLM2's layout: a Q8_0 embedding tied to the LM head. Looked-up rows equal gguf's
    dequantize exactly; the head is int8 per vocabulary row (one parameter loaded once)."""
    raw, _ = gguf_blocks("Q8_0", 300, 128, seed=5)
    ref = reference(raw, "Q8_0")
    config = GgufConfig({"embed_tokens.weight": "Q8_0"})
    embedding = embedding_layer(config, 300, 128)
    head = lm_head_layer(config, 300, 128, tied=True)
    assert isinstance(embedding, GgufEmbedding) and isinstance(head, GgufLMHead)
    head.weight = embedding.weight
    embedding.load_weight("weight", raw)
    embedding.process_after_loading()
    head.process_after_loading()
    ids = torch.tensor([0, 299, 17, 17, 5])
    assert torch.equal(embedding(ids), ref[ids])
    hidden = torch.randn(4, 128)
    assert rel(head(hidden), hidden.double() @ ref.double().t()) < 1e-2
    assert head.qweight.dtype == torch.int8


def test_dense_embedding_and_head_share_one_tensor():
    """quantization="none": both dense in the model dtype, one tensor as before."""
    raw, _ = gguf_blocks("Q8_0", 300, 128, seed=6)
    config = GgufConfig({"embed_tokens.weight": "Q8_0"}, dequantize=True)
    embedding, head = embedding_layer(config, 300, 128), lm_head_layer(config, 300, 128, True)
    head.weight = embedding.weight
    embedding.load_weight("weight", raw)
    embedding.process_after_loading()
    head.process_after_loading()
    assert head.weight is embedding.weight and embedding.weight.dtype == torch.float32
    assert torch.equal(embedding.weight, reference(raw, "Q8_0"))


def test_float_vocab_tensors_keep_the_plain_layers():
    config = GgufConfig({"embed_tokens.weight": "F16", "lm_head.weight": "Q6_K"})
    assert not isinstance(embedding_layer(config, 64, 256), GgufEmbedding)
    assert isinstance(lm_head_layer(config, 64, 256, tied=False), GgufLMHead)
    assert not isinstance(lm_head_layer(config, 64, 256, tied=True), GgufLMHead)
