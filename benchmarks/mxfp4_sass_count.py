"""The MXFP4 experts kernel (tllm.kernels.triton.swiglu_moe) compiled for sm_90 on a machine
without a GPU (Triton's bundled ptxas, as w4a16_sass_count.py): per GEMM of GPT-OSS-20B's
experts (H = I = 2880, bf16 activations) and tile, its shared memory, spilled-register
instructions and the SASS instructions of its K loop per weight a thread dequantizes (a
decode step's MXFP4 GEMM is bound by instruction issue, not bytes). A static count, not a
timing. --kernel-file: another copy of swiglu_moe.py (an older version, to compare).

    python benchmarks/mxfp4_sass_count.py [--kernel-file /tmp/old_swiglu_moe.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from w4a16_sass_count import hottest_loop, sass_of  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTRS = {"out_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*u8", "scales_ptr": "*u8",
        "bias_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
        "num_padded_ptr": "*i32", "topk_weights_ptr": "*fp32"}
FLOATS = ("alpha", "limit")
DIV16 = ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_bias",
         "stride_om")
# (label, block_m, block_n, block_k, warps, stages): decode's tiles (block_m 1: the GEMV),
# old and new tables, and prefill's
TILES = (("bf16 table, decode", 16, 32, 128, 4, 4), ("m16 n32 k256", 16, 32, 256, 4, 3),
         ("n16 k256", 16, 16, 256, 4, 4), ("gemv n32 k256", 1, 32, 256, 4, 3),
         ("gemv n64 k256", 1, 64, 256, 4, 3), ("prefill m64", 64, 64, 128, 4, 3),
         ("prefill m128", 128, 128, 128, 8, 3))


def load_kernel(path: str | None):
    if path is None:
        from tllm.kernels.triton import swiglu_moe
        return swiglu_moe._swiglu_expert_gemm_kernel
    spec = importlib.util.spec_from_file_location("swiglu_moe_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._swiglu_expert_gemm_kernel


def compile_for_sm90(kernel, constexprs: dict, num_warps: int, num_stages: int):
    names = kernel.arg_names
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # older kernels: fewer
    sig = {n: "constexpr" if n in constexprs else PTRS.get(n, "fp32" if n in FLOATS else "i32")
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in PTRS or n in DIV16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def count(kernel, gated: bool, scaled: bool, tile) -> str:
    _, block_m, block_n, block_k, warps, stages = tile
    constexprs = dict(ROWS_PER_A=4 if gated else 1, GATED=gated, MUL_WEIGHT=not gated,
                      MXFP4=True, SCALED_DOT=scaled, GEMV=block_m == 1, HAS_BIAS=True,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                      DOT_FP32=False, PRECISION="tf32")
    try:
        compiled = compile_for_sm90(kernel, constexprs, warps, stages)
    except Exception as exc:  # record, go on
        return f"{'':>8}  {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
    ins = sass_of(compiled)
    spills = sum(1 for op, _ in ins if op in ("LDL", "STL"))
    loop = sum(hottest_loop(ins).values())
    # the K loop holds gate and up (a GEMV: one loop each)
    weights = (2 if gated and block_m > 1 else 1) * block_k * block_n / (32 * warps)
    return f"{compiled.metadata.shared:>8}{spills:>7}{loop:>7}{loop / weights:>12.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-file", default=None, help="another swiglu_moe.py")
    args = parser.parse_args()
    kernel = load_kernel(args.kernel_file)
    dots = ("bits",) if "SCALED_DOT" not in kernel.arg_names else ("bits", "scaled")
    print(f"{'gemm':<8}{'dot':<8}{'tile':<22}{'smem':>8}{'spill':>7}{'loop':>7}"
          f"{'per weight':>12}")
    for gated in (True, False):
        for dot in dots:
            for tile in (t for t in TILES if dot == "bits" or t[1] > 1):
                print(f"{'gate_up' if gated else 'down':<8}{dot:<8}{tile[0]:<22}"
                      f"{count(kernel, gated, dot == 'scaled', tile)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
