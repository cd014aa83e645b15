"""The dense GEMV (tllm.kernels.triton.dense_gemv) compiled for sm_90 on a machine without a
GPU (Triton's bundled ptxas / cuobjdump), for every launch benchmarks/gpu_gemv.py sweeps at
M = 1: registers a thread, shared memory, spilled-register instructions, whether the K loop's
loads were pipelined (cp.async copies in the TTGIR) and the SASS instructions of its K loop
per weight a thread handles. A static count, not a timing.

    python benchmarks/dense_gemv_sass_count.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gpu_gemv import GATED_GRID, PLAIN_GRID  # noqa: E402
from tllm.kernels.triton.dense_gemv import _dense_gemv_kernel  # noqa: E402
from w4a16_sass_count import hottest_loop, sass_of  # noqa: E402

PTRS = {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16"}
DIV16 = ("N_OUT", "K", "stride_xm", "stride_wn", "stride_om")


def compile_for_sm90(block_n, block_k, gated, num_warps, num_stages):
    """Specialised as the launcher does at Llama's shapes (pointers, multiples of 16)."""
    constexprs = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, EVEN_K=True,
                      NUM_STAGES=num_stages)
    names = _dense_gemv_kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else PTRS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in PTRS or n in DIV16}
    src = ASTSource(fn=_dense_gemv_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def registers(compiled) -> str:
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                               text=True).stdout
    finally:
        os.unlink(f.name)
    found = re.search(r"REG:(\d+)", usage)
    return found.group(1) if found else "?"


def main() -> int:
    print(f"Triton {triton.__version__}, sm_90, bf16, M = 1")
    print(f"{'kind':<9}{'launch':<22}{'regs':>6}{'smem':>8}{'spill':>7}{'cp.async':>9}"
          f"{'loop':>6}{'per weight':>12}")
    for kind, grid in (("plain", PLAIN_GRID), ("silu_mul", GATED_GRID)):
        for block_n, block_k, warps, stages in grid:
            compiled = compile_for_sm90(block_n, block_k, kind == "silu_mul", warps, stages)
            ins = sass_of(compiled)
            spills = sum(1 for op, _ in ins if op in ("LDL", "STL"))
            loop = sum(hottest_loop(ins).values())
            rows = block_n * (2 if kind == "silu_mul" else 1)
            weights = rows * block_k // (32 * warps)
            copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
            label = f"n{block_n} k{block_k} w{warps} s{stages}"
            print(f"{kind:<9}{label:<22}{registers(compiled):>6}{compiled.metadata.shared:>8}"
                  f"{spills:>7}{copies:>9}{loop:>6}{loop / weights:>12.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
