"""The W4A16 kernels (tllm.kernels.triton.w4a16_*) compiled for sm_90 on a machine without a
GPU (Triton's bundled ptxas / cuobjdump): for every launch of w4a16_gemm.sweep_configs, its
shared memory, spilled-register instructions and the SASS instructions of its K loop per
weight a thread handles (the loop of an M = 1 GEMV is bound by instruction issue: ~33 G
thread-instructions a millisecond on an H200 against 6.4 G int4 weights at 3.2 TB/s).
A static count, not a timing.

    python benchmarks/w4a16_sass_count.py            # all buckets, bf16 activations
    python benchmarks/w4a16_sass_count.py 1 16       # M buckets
"""
from __future__ import annotations

import collections
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tllm.kernels.triton.w4a16_gemm import _mm_kernel, sweep_configs, usable  # noqa: E402
from tllm.kernels.triton.w4a16_gemv import _gemv_kernel  # noqa: E402
from tllm.kernels.triton.w4a16_mm import _mm_wx_kernel  # noqa: E402
from tllm.kernels.woq import WoqLayout  # noqa: E402

PTRS = {"out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "x_ptr": "*bf16",
        "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16"}
DIV16 = ("N", "stride_qn", "stride_sg", "stride_xm", "stride_om", "stride_ps", "stride_pm")
INSTRUCTION = re.compile(r"^\S+\t(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.A-Z0-9_]*\s*(.*)$")


def compile_for_sm90(kernel, constexprs: dict, num_warps: int, num_stages: int):
    """Triton's launcher specialises pointers and multiples of 16 the same way."""
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else PTRS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in PTRS or n in DIV16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def sass_of(compiled) -> list[tuple[str, str]]:
    sass = compiled.asm.get("sass")
    if not sass:
        from triton.tools.disasm import get_sass
        sass = get_sass(compiled.asm["cubin"])
    out = []
    for line in sass.splitlines():
        if re.match(r"^\.?\w+:$", line.strip()):
            out.append(("LABEL", line.strip()[:-1]))
        elif (m := INSTRUCTION.match(line)):
            out.append((m.group(2), m.group(3)))
    return out


def hottest_loop(ins: list[tuple[str, str]]) -> collections.Counter:
    """The instructions of the longest backward-branch body (the K loop)."""
    labels = {arg: i for i, (op, arg) in enumerate(ins) if op == "LABEL"}
    best: collections.Counter = collections.Counter()
    for i, (op, arg) in enumerate(ins):
        target = arg.strip().rstrip(";").split()[-1] if op == "BRA" and arg.strip() else ""
        if target in labels and labels[target] < i:
            body = collections.Counter(o for o, _ in ins[labels[target]:i + 1] if o != "LABEL")
            if sum(body.values()) > sum(best.values()):
                best = body
    return best


def launch(cfg, m: int):
    """(kernel, constexprs, weights a thread multiplies per loop iteration)."""
    layout = WoqLayout(4, 128, 16)
    cfg = usable(cfg, m, 4096, 4096, layout, torch.device("cpu"))
    common = dict(BITS=4, GROUP=128, KW=16, IS_SPLIT=cfg.split_k > 1)
    threads = 32 * cfg.num_warps
    if cfg.kind == "gemv":
        return cfg, _gemv_kernel, dict(common, BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks,
                                       PACKED=cfg.packed), cfg.block_n * cfg.chunks * 128 // threads
    dot = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_FP32=False,
               PRECISION="tf32")
    if cfg.kind == "wx":
        return cfg, _mm_wx_kernel, dict(dot, PAIRS=cfg.packed), cfg.block_n * 128 // threads
    return cfg, _mm_kernel, dict(dot, GROUP_M=cfg.group_m), cfg.block_n * 128 // threads


def main() -> int:
    buckets = [int(a) for a in sys.argv[1:]] or [1, 16, 64, 256]
    print(f"{'M':>4}  {'launch':<40}{'smem':>8}{'spill':>7}{'loop':>7}{'per weight':>12}")
    for m in buckets:
        for cfg in sweep_configs(m):
            if cfg.resolved_kind == "dequant":
                continue
            cfg, kernel, constexprs, weights = launch(cfg, m)
            compiled = compile_for_sm90(kernel, constexprs, cfg.num_warps, cfg.num_stages)
            ins = sass_of(compiled)
            spills = sum(1 for op, _ in ins if op in ("LDL", "STL"))
            loop = hottest_loop(ins)
            count = sum(loop.values())
            print(f"{m:>4}  {cfg.label():<40}{compiled.metadata.shared:>8}{spills:>7}"
                  f"{count:>7}{count / weights:>12.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
