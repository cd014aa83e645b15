"""GGUF layers in their CUDA form (tllm.layers.quant.gguf_cuda): the blocks kept as planes and
multiplied by the Triton kernels. On a GPU as they run there; on the CPU under the Triton
interpreter, with the device rule patched so the same code path runs. Each type's weight
equals gguf's dequantize exactly, products match a float64 reference, merged layers in mixed
types become Q8_0, tied vocabulary layers share one buffer, the weights take about the file's
bytes, and a tiny GGUF Llama gives the same greedy tokens kept as dequantized."""
from __future__ import annotations

import pytest
import torch

from tllm.attention.testing import setup_triton_for_tests

DEVICE = setup_triton_for_tests()  # before triton is imported: the interpreter on a CPU
pytest.importorskip("triton")

from tests.kernels.gguf_blocks import random_blocks  # noqa: E402
from tllm.distributed import comm  # noqa: E402
from tllm.kernels.gguf import BLOCK_BYTES, KERNEL_TYPES  # noqa: E402
from tllm.layers.linear import Linear, QKVLinear, RowParallelLinear  # noqa: E402
from tllm.layers.quant import UNQUANTIZED, embedding_layer, lm_head_layer, gguf_cuda  # noqa: E402
from tllm.layers.quant.gguf import GgufConfig, GgufLinearMethod, dequantize_blocks  # noqa: E402

SHARDS = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(autouse=True)
def planes_here(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setattr(gguf_cuda, "uses_planes", lambda weight: True)


def loaded(layer, raw):
    layer.load_weight("weight", raw.to(DEVICE))
    layer.quant.process_after_loading(layer)
    return layer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm()).item()


def build(make):
    with torch.device(DEVICE):
        return make()


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_linear_keeps_its_blocks(qtype):
    k = 512
    raw = random_blocks(qtype, 48, k, seed=1)
    ref = dequantize_blocks(raw, qtype)
    layer = loaded(build(lambda: Linear(k, 48, quant=GgufConfig(
        {"layers.0.mlp.down_proj.weight": qtype}).linear_method("layers.0.mlp.down_proj"))), raw)
    assert layer.quant.form == "planes" and not hasattr(layer, "weight")
    assert layer.gguf_planes.dtype == torch.uint8
    nbytes, values = BLOCK_BYTES[qtype]
    assert layer.gguf_planes.numel() <= 48 * k // values * nbytes * 1.03 + 6 * 256
    assert torch.equal(layer.quant.dequantized_weight(layer).cpu(), ref)
    for tokens in (1, 3):
        x = torch.randn(tokens, k, device=DEVICE)
        assert rel(layer(x), x.double().cpu() @ ref.double().t()) < 1e-5


def test_mixed_merged_layer_becomes_q8_0():
    """Q4_K_M's qkv (Q4_K q and k, a Q6_K v) reaches the method as float rows: Q8_0 blocks
    of those rows, ~0.4% from them."""
    types = {f"layers.0.self_attn.{p}.weight": "Q4_K" for p in SHARDS}
    types["layers.0.self_attn.v_proj.weight"] = "Q6_K"
    method = GgufConfig(types).linear_method("layers.0.self_attn.qkv_proj", SHARDS)
    layer = build(lambda: QKVLinear(256, 32, num_heads=4, num_kv_heads=2, quant=method))
    floats = [dequantize_blocks(random_blocks(qtype, rows, 256, seed=i), qtype)
              for i, (qtype, rows) in enumerate((("Q4_K", 128), ("Q4_K", 64), ("Q6_K", 64)))]
    for i, rows in enumerate(floats):
        layer.load_shard("weight", i, rows.to(DEVICE))
    layer.quant.process_after_loading(layer)
    assert (layer.quant.qtype, layer.quant.form) == ("Q8_0", "planes")
    expected = torch.cat(floats)
    assert rel(layer.quant.dequantized_weight(layer), expected) < 8e-3
    x = torch.randn(2, 256, device=DEVICE)
    assert rel(layer(x), x.double().cpu() @ expected.double().t()) < 1e-2


def test_dense_switch_and_types_without_a_kernel():
    """quantization="none" (dequantize) and Q3_K: dense in the model dtype, as before."""
    raw = random_blocks("Q4_K", 32, 256, seed=2)
    config = GgufConfig({"layers.0.mlp.down_proj.weight": "Q4_K"}, dequantize=True)
    layer = loaded(build(lambda: Linear(256, 32, quant=config.linear_method(
        "layers.0.mlp.down_proj"))), raw)
    assert layer.quant.form == "dense" and torch.equal(layer.weight.cpu(),
                                                       dequantize_blocks(raw, "Q4_K"))
    assert GgufConfig(config.tensor_types, dequantize=True).linear_method(
        "layers.0.self_attn.qkv_proj", SHARDS) is UNQUANTIZED
    raw = random_blocks("Q6_K", 32, 256, seed=3)
    raw3 = torch.zeros(32, 1, 110, dtype=torch.uint8)
    raw3[..., 108:110] = raw[..., 208:210]    # a finite fp16 d
    q3 = loaded(build(lambda: Linear(256, 32, quant=GgufLinearMethod("Q3_K", "dense"))), raw3)
    assert q3.quant.form == "dense" and q3.weight.dtype == torch.float32


def test_row_parallel_slice(monkeypatch):
    raw = random_blocks("Q5_K", 32, 1024, seed=4)
    full = dequantize_blocks(raw, "Q5_K")
    monkeypatch.setattr(comm, "tp_rank_and_size", lambda: (1, 2))
    layer = loaded(build(lambda: RowParallelLinear(1024, 32, quant=GgufLinearMethod(
        "Q5_K", "int8"))), raw)
    assert layer.quant.form == "planes"
    assert torch.equal(layer.quant.dequantized_weight(layer).cpu(), full[:, 512:])


def test_tied_embedding_and_head_share_one_buffer():
    raw = random_blocks("Q8_0", 300, 128, seed=5)
    ref = dequantize_blocks(raw, "Q8_0")
    config = GgufConfig({"embed_tokens.weight": "Q8_0"})
    embedding, head = build(lambda: (embedding_layer(config, 300, 128),
                                     lm_head_layer(config, 300, 128, tied=True)))
    head.weight = embedding.weight
    embedding.load_weight("weight", raw.to(DEVICE))
    embedding.process_after_loading()
    head.process_after_loading()
    assert head.weight is embedding.weight and embedding.weight.dim() == 1
    assert embedding.weight.numel() < raw.numel() + 2 * 256
    ids = torch.tensor([0, 299, 17, 17, 5], device=DEVICE)
    assert torch.equal(embedding(ids).cpu(), ref[ids.cpu()])
    hidden = torch.randn(3, 128, device=DEVICE)
    assert rel(head(hidden), hidden.double().cpu() @ ref.double().t()) < 1e-5
    assert rel(head(hidden[:1]), hidden[:1].double().cpu() @ ref.double().t()) < 1e-5


def test_untied_q6_k_head():
    raw = random_blocks("Q6_K", 96, 256, seed=6)
    head = build(lambda: lm_head_layer(GgufConfig({"lm_head.weight": "Q6_K"}), 96, 256, False))
    head.load_weight("weight", raw.to(DEVICE))
    head.process_after_loading()
    hidden = torch.randn(2, 256, device=DEVICE)
    ref = dequantize_blocks(raw, "Q6_K").double()
    assert rel(head(hidden), hidden.double().cpu() @ ref.t()) < 1e-5


@pytest.mark.slow  # ~20 s under the interpreter: every linear of every step is interpreted
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_tiny_llama_kept_equals_dequantized(tmp_path, qtype):
    """A tiny GGUF Llama (every matrix in `qtype`, the embedding too) in float32: the kept
    planes give the greedy tokens of the same file dequantized at load."""
    from tests.loader.gguf_writer import write_gguf
    from tests.models.test_dense_parity import save_tiny
    from tllm import LLM, SamplingParams
    path = write_gguf(save_tiny("Llama", tmp_path / "hf"), tmp_path / "tiny.gguf", "llama",
                      qtype)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [250, 7, 7, 31, 64, 2, 9])]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {}
    for quantization in (None, "none"):
        with LLM(str(path), dtype="float32", quantization=quantization) as llm:
            model = llm._engine.executor.runner.model
            forms = {m.quant.form for m in model.modules()
                     if isinstance(getattr(m, "quant", None), GgufLinearMethod)}
            outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[quantization] = [o.outputs[0].token_ids for o in outputs], forms
    assert runs[None][1] == {"planes"} and runs["none"][1] <= {"dense"}
    assert runs[None][0] == runs["none"][0]


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU form (tests/loader checks the CPU's)")
def test_smollm2_kept_on_gpu_matches_dequantized():
    """SmolLM2 (Q4_1 linears, a tied Q8_0 embedding) kept as planes against the file
    dequantized to bf16: greedy 32 tokens on 4 prompts equal, or where they first part each
    side's token is in the other's top-5 (the kept GEMV accumulates float32 products of the
    exact weights, the dense path bf16-rounded weights through cuBLAS: a near tie can flip);
    the weights take about the file's bytes."""
    from tests.loader.test_gguf_quantized import PROMPTS, run
    from tllm.loader import CheckpointError, smollm2_path
    try:
        file_bytes = smollm2_path().stat().st_size
    except CheckpointError as exc:
        pytest.skip(str(exc))
    kept, info = run(None)
    dense, dense_info = run("none")
    assert info["forms"] == {"planes"} and dense_info["forms"] <= {"dense"}
    assert info["bytes"] < 1.1 * file_bytes, (info["bytes"], file_bytes)
    for prompt, a, b in zip(PROMPTS, kept, dense):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[i] and tb in a.logprobs[i], (prompt, i)
                break
