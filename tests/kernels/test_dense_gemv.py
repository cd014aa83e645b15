"""The dense small-M GEMV (tllm.kernels.triton.dense_gemv) against its float32 references,
plain and with the SiLU-and-mul epilogue, at M = 1..5, N and K off the block sizes, several
launches; its custom ops and torch.compile; the dispatch rules of
tllm.layers.dense_gemv_dispatch (a table on or off, TLLM_DENSE_GEMV, bias, M > 1, CPU);
on a GPU, a tiny Llama's greedy tokens with the GEMV on and off (eager, CUDA graphs, and
graphs from the compiled model)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import custom_ops  # noqa: E402,F401  (registers torch.ops.tllm.*)
from tllm.kernels.triton import dense_gemv as kernels  # noqa: E402
from tllm.kernels.triton.dense_gemv import (dense_gemv, dense_gemv_ref,  # noqa: E402
                                            dense_gemv_silu_mul, dense_gemv_silu_mul_ref)
from tllm.kernels.triton.dense_gemv_configs import (DEFAULT_CONFIGS, DenseGemvConfig,  # noqa
                                                    TableEntry, device_file_name,
                                                    load_table, table_to_json)
from tllm.layers import dense_gemv_dispatch as dispatch  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ON_CPU = not torch.cuda.is_available()


def silu_mul_tol(dtype) -> float:
    # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): g, u and the
    # output each lose up to a bf16 unit, twice what the rounding reference expects
    return 2e-2 if dtype == torch.bfloat16 and ON_CPU else TOL[dtype]


def inputs(m, n, k, dtype, device):
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (1, 36, 200), (2, 40, 128), (3, 20, 96),
                                   (4, 64, 64), (5, 18, 48)])
def test_default_launch_matches_the_references(device, dtype, m, n, k):
    x, w = inputs(m, n, k, dtype, device)
    out = dense_gemv(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    assert relative_error(out, dense_gemv_ref(x, w)) < TOL[dtype]
    gated = dense_gemv_silu_mul(x, w)
    assert gated.shape == (m, n // 2) and gated.dtype == dtype
    assert relative_error(gated, dense_gemv_silu_mul_ref(x, w)) < silu_mul_tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 36, 200), (3, 20, 96)])
def test_bias_in_the_epilogue(device, dtype, m, n, k):
    x, w = inputs(m, n, k, dtype, device)
    bias = torch.randn(n, device=device).to(dtype)
    out = dense_gemv(x, w, DenseGemvConfig(8, 64, 2, 2), bias)   # a partial last n tile
    assert relative_error(out, dense_gemv_ref(x, w, bias)) < TOL[dtype]
    with pytest.raises(ValueError, match="bias"):
        dense_gemv(x, w, bias=bias[:-1])


@pytest.mark.parametrize("cfg", [DenseGemvConfig(1, 32, 1, 1), DenseGemvConfig(8, 16, 2, 3),
                                 DenseGemvConfig(2, 64, 4, 2), DenseGemvConfig(16, 512, 4, 1)])
@pytest.mark.parametrize("m", [1, 3])
def test_launches_off_the_block_sizes(device, cfg, m):
    # N not a multiple of block_n (rows clamped, not stored), K not a multiple of block_k
    # (masked loads), block_k wider than K (clamped to K's power of two)
    x, w = inputs(m, 2 * 13, 80, torch.bfloat16, device)
    assert relative_error(dense_gemv(x, w, cfg), dense_gemv_ref(x, w)) < 1e-2
    gated = dense_gemv_silu_mul(x, w, cfg)
    assert relative_error(gated, dense_gemv_silu_mul_ref(x, w)) < silu_mul_tol(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_epilogue_is_silu_mul_of_the_rounded_products(device, dtype):
    """silu_mul's output is SiluAndMul of the plain GEMV's own (rounded) g and u, to within
    the output's rounding: the epilogue rounds g and u first, as the unfused path does."""
    x, w = inputs(1, 96, 128, dtype, device)
    gate, up = dense_gemv(x, w).float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = dense_gemv_silu_mul(x, w).float()
    assert relative_error(got, want) < 4e-3


def test_leading_dims_and_bad_input(device):
    x, w = inputs(1, 32, 64, torch.float16, device)
    assert dense_gemv(x.view(1, 1, 64), w).shape == (1, 1, 32)
    assert dense_gemv_silu_mul(x[0], w).shape == (16,)
    with pytest.raises(ValueError, match="features"):
        dense_gemv(x[:, :32], w)
    with pytest.raises(ValueError, match="x is"):
        dense_gemv(x.float(), w)
    with pytest.raises(ValueError, match="row-major"):
        dense_gemv(x[:, :32], w.t())
    with pytest.raises(ValueError, match="odd"):
        dense_gemv_silu_mul(x, w[:31])
    assert dense_gemv(x[:0], w).shape == (0, 32)


def test_custom_ops(device):
    x, w = inputs(1, 32, 64, torch.float32, device)
    ops = torch.ops.tllm
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.dense_gemv, (x, w, 4, 32, 1, 1), test_utils=checks)
    torch.library.opcheck(ops.dense_gemv_silu_mul, (x, w, 4, 32, 1, 1), test_utils=checks)
    assert relative_error(ops.dense_gemv(x, w, 4, 32, 1, 1), dense_gemv_ref(x, w)) < 1e-5
    assert relative_error(ops.dense_gemv_silu_mul(x, w, 4, 32, 1, 1),
                          dense_gemv_silu_mul_ref(x, w)) < 1e-5


# ---- dispatch ---------------------------------------------------------------------------

def write_table(path, rows):
    path.write_text(json.dumps(rows))
    return str(path)


def table_row(kind, n, k, use, **launch):
    return {"kind": kind, "n": n, "k": k, "use": use, "block_n": 2, "block_k": 32,
            "num_warps": 1, "num_stages": 1, **launch}


@pytest.fixture
def gpu_like(monkeypatch):
    """The dispatch as it decides for CUDA tensors, on whatever device the test runs."""
    monkeypatch.setattr(dispatch, "_runs_kernels", lambda x: True)


def test_decide_follows_the_table_and_the_switch(tmp_path, monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv(dispatch.TABLE_ENV, str(tmp_path / "missing.json"))
    assert dispatch.decide("plain", 64, 128, cuda) is None          # no table: cuBLAS
    monkeypatch.setenv(dispatch.MODE_ENV, "1")
    assert dispatch.decide("plain", 64, 128, cuda) == DEFAULT_CONFIGS["plain"]
    monkeypatch.setenv(dispatch.TABLE_ENV, write_table(tmp_path / "t.json", [
        table_row("plain", 64, 128, True, block_n=8), table_row("silu_mul", 64, 128, False)]))
    for mode, plain, gated in (("auto", 8, None), ("1", 8, 2), ("0", None, None)):
        monkeypatch.setenv(dispatch.MODE_ENV, mode)
        got = dispatch.decide("plain", 64, 128, cuda)
        assert (got and got.block_n) == plain, mode
        got = dispatch.decide("silu_mul", 64, 128, cuda)
        assert (got and got.block_n) == gated, mode
    monkeypatch.setenv(dispatch.MODE_ENV, "auto")
    assert dispatch.decide("plain", 64, 256, cuda) is None           # no row for the shape
    assert dispatch.decide("plain", 64, 128, torch.device("cpu")) is not None  # the path's
    monkeypatch.setenv(dispatch.MODE_ENV, "yes")
    with pytest.raises(ValueError, match="TLLM_DENSE_GEMV"):
        dispatch.decide("plain", 64, 128, cuda)


def test_no_table_on_a_cpu_without_a_path(monkeypatch):
    monkeypatch.delenv(dispatch.TABLE_ENV, raising=False)
    monkeypatch.delenv(dispatch.MODE_ENV, raising=False)
    assert dispatch.decide("plain", 64, 128, torch.device("cpu")) is None


def test_table_json_round_trip(tmp_path):
    table = {("plain", 6144, 4096): TableEntry(True, DenseGemvConfig(2, 2048, 8, 3)),
             ("silu_mul", 28672, 4096): TableEntry(False, DenseGemvConfig())}
    path = tmp_path / "t.json"
    path.write_text(table_to_json(table, {("plain", 6144, 4096): {"us": 12.5}}))
    assert load_table(str(path)) == table
    assert device_file_name("NVIDIA H200") == "dense_gemv_NVIDIA_H200.json"


def plain_linear(n, k, dtype, device, bias=False):
    from tllm.layers.linear import Linear
    layer = Linear(k, n, bias=bias).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k) / k ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(n))
    return layer


def test_linear_takes_the_gemv_only_when_eligible(device, tmp_path, monkeypatch, gpu_like):
    monkeypatch.setenv(dispatch.TABLE_ENV, write_table(tmp_path / "t.json", [
        table_row("plain", 24, 64, True)]))
    monkeypatch.setenv(dispatch.MODE_ENV, "auto")
    layer = plain_linear(24, 64, torch.float16, device)
    x = torch.randn(1, 64, device=device).half()
    calls = []
    monkeypatch.setattr(kernels, "dense_gemv",
                        lambda *a, **kw: calls.append(1) or dense_gemv(*a, **kw))
    out = layer(x)
    assert calls and relative_error(out, dense_gemv_ref(x, layer.weight)) < 1e-2
    assert dispatch.dense_linear(layer, torch.randn(2, 64, device=device).half()) is None
    assert dispatch.dense_linear(layer, x.float()) is None                    # fp32
    biased = plain_linear(24, 64, torch.float16, device, bias=True)
    calls.clear()   # a biased layer: the GEMV adds its bias in the epilogue
    out = biased(x)
    assert calls and relative_error(out, dense_gemv_ref(x, biased.weight, biased.bias)) < 1e-2
    assert dispatch.dense_linear(biased, x, biased.bias.float()) is None      # bias dtype
    assert dispatch.dense_linear(plain_linear(24, 32, torch.float16, device),
                                 x[:, :32]) is None                           # not in table


def test_linear_on_a_cpu_keeps_f_linear(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.TABLE_ENV, write_table(tmp_path / "t.json", [
        table_row("plain", 24, 64, True)]))
    monkeypatch.setenv(dispatch.MODE_ENV, "1")
    layer = plain_linear(24, 64, torch.bfloat16, "cpu")
    assert dispatch.dense_linear(layer, torch.randn(1, 64).bfloat16()) is None


def tiny_mlp(device, dtype=torch.float16):
    from transformers import LlamaConfig

    from tllm.models.llama import LlamaMLP
    config = LlamaConfig(hidden_size=64, intermediate_size=48)
    mlp = LlamaMLP(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape) / 8)
    return mlp


def unfused(mlp, x):
    gate, up = F.linear(x, mlp.gate_up_proj.weight).float().chunk(2, dim=-1)
    return F.linear((F.silu(gate) * up).to(x.dtype), mlp.down_proj.weight)


def test_mlp_fuses_gate_up_and_silu_only_when_eligible(device, tmp_path, monkeypatch,
                                                       gpu_like):
    from tllm.layers.activation import GeluAndMul
    from tllm.lora.layers import LoraLinearMethod
    monkeypatch.setenv(dispatch.TABLE_ENV, write_table(tmp_path / "t.json", [
        table_row("silu_mul", 96, 64, True)]))
    monkeypatch.setenv(dispatch.MODE_ENV, "auto")
    mlp = tiny_mlp(device)
    x = torch.randn(1, 64, device=device).half()
    fused = dispatch.gate_up_silu_mul(mlp.gate_up_proj, mlp.act, mlp.down_proj, x)
    assert fused is not None and fused.shape == (1, 48)
    assert relative_error(mlp(x), unfused(mlp, x)) < 1e-2
    rows2 = torch.randn(2, 64, device=device).half()
    assert dispatch.gate_up_silu_mul(mlp.gate_up_proj, mlp.act, mlp.down_proj, rows2) is None
    assert dispatch.gate_up_silu_mul(mlp.gate_up_proj, GeluAndMul(), mlp.down_proj, x) is None
    lora = LoraLinearMethod.__new__(LoraLinearMethod)
    monkeypatch.setattr(mlp.gate_up_proj, "quant", lora)
    assert dispatch.gate_up_silu_mul(mlp.gate_up_proj, mlp.act, mlp.down_proj, x) is None


def test_compile_keeps_the_gemv_whole(device, tmp_path, monkeypatch, gpu_like):
    monkeypatch.setenv(dispatch.TABLE_ENV, write_table(tmp_path / "t.json", [
        table_row("plain", 24, 64, True), table_row("silu_mul", 96, 64, True),
        table_row("plain", 16, 24, True)]))
    monkeypatch.setenv(dispatch.MODE_ENV, "auto")
    layer = plain_linear(24, 64, torch.float32, device)
    biased = plain_linear(16, 24, torch.float32, device, bias=True)
    mlp = tiny_mlp(device, torch.float32)
    monkeypatch.setattr(dispatch, "_DTYPES", (torch.float32,))  # the interpreter's exact math

    def block(x):
        return biased(layer(mlp(x)))

    x = torch.randn(1, 64, device=device)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0
    ops = [str(node.target) for g in explanation.graphs for node in g.graph.nodes]
    assert "tllm.dense_gemv.default" in ops and "tllm.dense_gemv_silu_mul.default" in ops
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), block(x))


# ---- end to end (GPU) -------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def greedy_run(path, prompts, graphs, compiled=False):
    from tllm import LLM, KvCacheConfig, SamplingParams
    from tllm.config import CudaGraphConfig
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    graph_config = CudaGraphConfig(batch_sizes=[1, 2], torch_compile=compiled) if graphs else None
    with LLM(str(path), dtype="float16", device="cuda", max_batch_size=2,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=2048),
             cuda_graph_config=graph_config) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                for p in prompts]   # one at a time: every decode step has one row
    return [o.outputs[0] for o in outs]


def same_or_top5(a, b) -> None:
    """DESIGN.md's rule: equal greedy tokens, or where they first part each side's token is in
    the other's top-5 (fp16 rounding may break a near tie)."""
    for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            assert ta in b.logprobs[step] and tb in a.logprobs[step], step
            return


@needs_gpu
@pytest.mark.parametrize("graphs,compiled", [(False, False), (True, False), (True, True)])
def test_tiny_llama_tokens_with_and_without_the_gemv(tiny_llama, monkeypatch, graphs,
                                                     compiled):
    path, model = tiny_llama
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 17)]
    calls = {"plain": 0, "silu_mul": 0}
    real_plain, real_gated = kernels.dense_gemv, kernels.dense_gemv_silu_mul
    monkeypatch.setattr(kernels, "dense_gemv", lambda *a, **kw: calls.__setitem__(
        "plain", calls["plain"] + 1) or real_plain(*a, **kw))
    monkeypatch.setattr(kernels, "dense_gemv_silu_mul", lambda *a, **kw: calls.__setitem__(
        "silu_mul", calls["silu_mul"] + 1) or real_gated(*a, **kw))
    monkeypatch.setenv(dispatch.MODE_ENV, "0")
    off = greedy_run(path, prompts, graphs, compiled)
    assert calls == {"plain": 0, "silu_mul": 0}
    monkeypatch.setenv(dispatch.MODE_ENV, "1")
    on = greedy_run(path, prompts, graphs, compiled)
    assert calls["plain"] > 0 and calls["silu_mul"] > 0, calls
    for a, b in zip(on, off):
        same_or_top5(a, b)
