"""The FP8 fused MoE Triton kernels against their torch references on tiny random experts, per
scale scheme (per channel, per tensor spread over rows, 32x32 blocks): W8A8 against the exact
emulation fp8_fused_experts_ref, W8A16 against fused_experts_ref on the dequantized weights;
with expert parallelism (pairs of other ranks' experts), and the emulation against a
dequantized float32 reference within fp8's error."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels import fp8 as ref  # noqa: E402
from tllm.kernels import moe  # noqa: E402
from tllm.kernels.fp8_moe import Fp8Experts, fp8_fused_experts_ref  # noqa: E402
from tllm.kernels.triton.fp8_fused_moe import fp8_fused_experts_triton  # noqa: E402
from tllm.kernels.triton.fp8_moe_configs import (FP8_CONFIGS, fp8_moe_config,  # noqa: E402
                                                 is_w8a8)
from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig  # noqa: E402

HIDDEN, INTER = 48, 32  # hidden not a multiple of the 32-column K tiles
BLOCK = (32, 32)  # an fp8 tl.dot needs K >= 32 on Hopper (16 failed to compile on an H100)
CUDA = torch.cuda.is_available()
SCHEMES = ["channel", "tensor", "block"]


def routing(num_tokens, top_k, num_global, device):
    weights, ids = torch.softmax(torch.randn(num_tokens, num_global), -1).topk(top_k, -1)
    return (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)


def quantize(w: torch.Tensor, scheme: str, block=BLOCK):
    """One expert's weight [N, K] -> (fp8, scale) in the run-time form of `scheme`."""
    if scheme == "block":
        return ref.quantize_blocks(w, block)
    if scheme == "tensor":
        scale = (w.abs().amax() / ref.FP8_MAX).reshape(1, 1)
        return ref.quantize_static(w, scale), scale.expand(w.shape[0], 1).contiguous()
    return ref.quantize_per_channel(w)


def fp8_experts(num_experts, scheme, device, hidden=HIDDEN, inter=INTER,
                block=BLOCK) -> Fp8Experts:
    parts = {"w13": [], "s13": [], "w2": [], "s2": []}
    for _ in range(num_experts):
        for name, shape in (("13", (2 * inter, hidden)), ("2", (hidden, inter))):
            q, s = quantize(torch.randn(*shape) / shape[1] ** 0.5, scheme, block)
            parts["w" + name].append(q)
            parts["s" + name].append(s)
    stacked = {k: torch.stack(v).to(device) for k, v in parts.items()}
    return Fp8Experts(stacked["w13"], stacked["s13"], stacked["w2"], stacked["s2"],
                      block if scheme == "block" else None)


def run_triton(hidden, experts: Fp8Experts, weights, ids, **kwargs):
    return fp8_fused_experts_triton(hidden, experts.w13, experts.w13_scale, experts.w2,
                                    experts.w2_scale, experts.block, weights, ids, **kwargs)


def on_cpu(experts: Fp8Experts) -> Fp8Experts:
    return Fp8Experts(*(t.cpu() for t in (experts.w13, experts.w13_scale, experts.w2,
                                          experts.w2_scale)), experts.block)


def dequantized_ref(hidden, experts, weights, ids, expert_start=0):
    """fused_experts_ref in float32 on the dequantized weights (unquantized activations)."""
    cpu = on_cpu(experts)
    w13, w2 = zip(*(cpu.dequantized(e) for e in range(cpu.num_experts)))
    return moe.fused_experts_ref(hidden.float().cpu(), torch.stack(w13), torch.stack(w2),
                                 weights.cpu(), ids.cpu(), expert_start)


# bf16 W8A8: the intermediate is rounded to bf16 before its fp8 quantization, so a bf16 ulp
# of difference in the accumulation may move an element across an e4m3 rounding boundary
# (2^-4 relative): a few such elements cost up to ~2e-2 of the whole
# fp32 W8A8 on a GPU: the fp8 tensor cores' ~14-bit accumulation within a K tile can flip
# such a rounding too
TOL = {(torch.float32, True): 3e-2 if CUDA else 1e-5, (torch.float32, False): 1e-5,
       (torch.bfloat16, True): 3e-2, (torch.bfloat16, False): 1e-2}
CONFIGS = {16: MoeConfig(16, GemmTile(16, 32), GemmTile(32, 32)),
           32: MoeConfig(32, GemmTile(32, 32), GemmTile(16, 32), group_m=2)}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("w8a8", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(device, scheme, w8a8, dtype):
    num_tokens, top_k, num_experts = 9, 2, 4
    experts = fp8_experts(num_experts, scheme, device)
    hidden = torch.randn(num_tokens, HIDDEN, device=device).to(dtype)
    weights, ids = routing(num_tokens, top_k, num_experts, device)
    cfg = CONFIGS[32 if w8a8 else 16]
    out = run_triton(hidden, experts, weights, ids, config=cfg, w8a8=w8a8)
    assert out.shape == hidden.shape and out.dtype == dtype and not out.isnan().any()
    if w8a8:  # the emulation quantizes the same rows the same way
        want = fp8_fused_experts_ref(hidden.cpu(), on_cpu(experts), weights.cpu(), ids.cpu())
    else:
        want = dequantized_ref(hidden, experts, weights, ids)
    assert relative_error(out.cpu(), want.float()) < TOL[dtype, w8a8]


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_kernel_expert_parallel(device, scheme):
    """This rank holds experts 2..5 of 8: pairs of the others add nothing."""
    num_tokens, top_k = 7, 3
    experts = fp8_experts(4, scheme, device)
    hidden = torch.randn(num_tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, top_k, 8, device)
    out = run_triton(hidden, experts, weights, ids, expert_start=2,
                                   config=CONFIGS[32], w8a8=True)
    want = fp8_fused_experts_ref(hidden.cpu(), on_cpu(experts), weights.cpu(), ids.cpu(), 2)
    assert relative_error(out.cpu(), want.float()) < TOL[torch.bfloat16, True]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_emulation_close_to_dequantized(scheme):
    """W8A8's two activation roundings cost ~4.5% of the output here (e4m3's 3 mantissa
    bits); a wrong scale costs far more."""
    experts = fp8_experts(4, scheme, "cpu")
    hidden = torch.randn(21, HIDDEN)
    weights, ids = routing(21, 2, 4, "cpu")
    got = fp8_fused_experts_ref(hidden, experts, weights, ids)
    assert relative_error(got, dequantized_ref(hidden, experts, weights, ids)) < 0.08


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_emulation_under_capture_equals_the_loop(scheme):
    """The emulation's form for a CUDA graph (every expert on every row, unrouted rows
    weighted 0) against its loop over routed rows; experts 2..5 of 8 on this rank."""
    from tllm.kernels.fp8_moe import _captured_experts_ref
    experts = fp8_experts(4, scheme, "cpu")
    hidden = torch.randn(11, HIDDEN).to(torch.bfloat16)
    weights, ids = routing(11, 3, 8, "cpu")
    got = _captured_experts_ref(hidden, experts, weights, ids - 2,
                                torch.zeros(11, HIDDEN, dtype=torch.float32))
    want = fp8_fused_experts_ref(hidden, experts, weights, ids, expert_start=2)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(not CUDA, reason="the CUDA kernels run on the GPU only")
@pytest.mark.parametrize("num_tokens", [1, 8, 200, 1500])
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_default_configs_on_gpu(num_tokens, scheme):
    """Mixtral-like width on the tile table's every row (W8A16 at decode tiles, W8A8 above);
    block scales 128x128."""
    hidden_size, inter, num_experts, top_k = 512, 256, 8, 2
    experts = fp8_experts(num_experts, scheme, "cuda", hidden_size, inter, (128, 128))
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, top_k, num_experts, "cuda")
    out = run_triton(hidden, experts, weights, ids)
    scheme_name = "block" if scheme == "block" else "channel"
    if is_w8a8(fp8_moe_config(num_tokens, top_k, num_experts, scheme_name)):
        want = fp8_fused_experts_ref(hidden.cpu(), on_cpu(experts), weights.cpu(), ids.cpu())
        assert relative_error(out.cpu(), want.float()) < TOL[torch.bfloat16, True]
    else:
        want = dequantized_ref(hidden, experts, weights, ids)
        assert relative_error(out.cpu(), want) < TOL[torch.bfloat16, False]


TABLE_CASES = sorted({(scheme, cfg) for scheme, rows in FP8_CONFIGS.items()
                      for _, cfg in rows}, key=str)


@pytest.mark.parametrize("scheme,cfg", TABLE_CASES)
def test_fp8_table_tiles_match_reference(device, scheme, cfg):
    """Every tile of the FP8 table (128-row tiles, block_k 256 clamped to the scale block)
    against its reference; K = 160 is not a multiple of the K tiles; 64 x 64 scale blocks."""
    hidden_size, inter, num_tokens, top_k = 160, 64, 12, 2
    block = (64, 64)
    experts = fp8_experts(4, scheme, device, hidden_size, inter, block)
    hidden = torch.randn(num_tokens, hidden_size, device=device).to(torch.bfloat16)
    weights, ids = routing(num_tokens, top_k, 4, device)
    out = run_triton(hidden, experts, weights, ids, config=cfg)
    if is_w8a8(cfg):
        want = fp8_fused_experts_ref(hidden.cpu(), on_cpu(experts), weights.cpu(), ids.cpu())
    else:
        want = dequantized_ref(hidden, experts, weights, ids)
    assert relative_error(out.cpu(), want.float()) < TOL[torch.bfloat16, is_w8a8(cfg)]


def test_fp8_moe_config_by_pairs_per_expert():
    assert not is_w8a8(fp8_moe_config(1, 2, 8, "channel"))  # decode: weight-only
    assert is_w8a8(fp8_moe_config(512, 2, 8, "block"))     # 128 pairs an expert
    assert fp8_moe_config(512, 2, 8).block_m >= fp8_moe_config(64, 2, 8).block_m
    for rows in FP8_CONFIGS.values():
        assert rows[-1][0] == float("inf")
        assert all(cfg.gate_up.block_k >= 32 and cfg.down.block_k >= 32 for _, cfg in rows)
    with pytest.raises(ValueError, match="scheme"):
        fp8_moe_config(8, 2, 8, "tensor")
