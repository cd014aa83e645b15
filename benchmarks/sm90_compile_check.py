"""The kernels a session changed, compiled for sm_90 on a machine without a GPU (Triton's
bundled ptxas, as mxfp4_sass_count.py): each launch form that the Triton interpreter's tests
cannot vouch will compile (the interpreter runs Python, not the compiler), with its registers
a thread, spilled-register instructions and shared memory. A compile error here is one fewer
failed device call; tests/kernels/test_sm90_compile.py runs it. Not a timing.

    python benchmarks/sm90_compile_check.py            # every case; exit 1 if one fails
    python benchmarks/sm90_compile_check.py moe_decode  # cases whose label starts so
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

from w4a16_sass_count import sass_of  # noqa: E402


def compile_for_sm90(kernel, pointers: dict, floats: tuple, constexprs: dict,
                     num_warps: int = 4, num_stages: int = 2):
    """The kernel with `pointers` {arg: "*bf16", ...}, `floats` fp32 scalars, the rest i32."""
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(
        n, "fp32" if n in floats else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def registers(compiled) -> int | str:
    """Registers a thread, from the cubin's resource usage (cuobjdump, bundled with Triton;
    CompiledKernel.n_regs is only known once loaded on a GPU)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):  # only the count is lost
        out = ""
    finally:
        os.unlink(f.name)
    found = re.search(r"REG:(\d+)", out)
    return int(found.group(1)) if found else "?"


def moe_decode_cases():
    from tllm.kernels.triton import moe_decode as m
    for weights, scales, label in (("*bf16", 0, "bf16"), ("*fp8e4nv", 1, "fp8 rows"),
                                   ("*fp8e4nv", 2, "fp8 blocks")):
        ptrs = {"inter_ptr": "*bf16", "hidden_ptr": "*bf16", "w_ptr": weights,
                "ws_ptr": "*fp32" if scales else weights, "topk_ids_ptr": "*i32",
                "out_ptr": "*bf16", "topk_weights_ptr": "*fp32"}
        block_k = 128 if scales == 2 else (2048 if scales else 1024)
        common = dict(NUM_EXPERTS=128, TOP_K=8, SCALES=scales, SCALE_BLOCK_N=128 if scales == 2
                      else 1, SCALE_BLOCK_K=128 if scales == 2 else 1, BLOCK_K=block_k,
                      EVEN_K=True, NUM_STAGES=2)
        yield (f"moe_decode gate_up {label}", m._pair_gate_up_kernel, ptrs, (),
               dict(common, GATED=True, BLOCK_N=2), 4, 2)
        yield (f"moe_decode down {label}", m._token_down_kernel, ptrs, (),
               dict(common, BLOCK_N=4), 4, 2)
    ptrs = {"inter_ptr": "*bf16", "hidden_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16",
            "topk_ids_ptr": "*i32"}
    yield ("moe_decode gate_up relu2", m._pair_gate_up_kernel, ptrs, (),
           dict(NUM_EXPERTS=64, TOP_K=6, GATED=False, SCALES=0, SCALE_BLOCK_N=1,
                SCALE_BLOCK_K=1, BLOCK_N=2, BLOCK_K=1024, EVEN_K=False, NUM_STAGES=2), 4, 2)


def swiglu_decode_cases():
    from tllm.kernels.triton import swiglu_moe_decode as m
    for mxfp4 in (True, False):
        weights = "*u8" if mxfp4 else "*bf16"
        ptrs = {"inter_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": weights, "out_ptr": "*bf16",
                "scales_ptr": "*u8" if mxfp4 else weights, "bias_ptr": "*bf16",
                "ids_ptr": "*i32", "topk_weights_ptr": "*fp32"}
        label = "mxfp4" if mxfp4 else "bf16"
        for kernel, tile, floats in zip((m._pair_swiglu_kernel, m._token_down_kernel),
                                        m.MXFP4_TILES if mxfp4 else m.PLAIN_TILES,
                                        (("alpha", "limit"), ())):
            common = dict(NUM_EXPERTS=32, TOP_K=4, MXFP4=mxfp4, HAS_BIAS=True,
                          BLOCK_N=tile.block_n, BLOCK_K=256 if mxfp4 else 1024, EVEN_K=mxfp4)
            name = "gate_up" if kernel is m._pair_swiglu_kernel else "down"
            yield (f"swiglu_decode {name} {label}", kernel, ptrs, floats, common,
                   tile.num_warps, tile.num_stages)


def kv_write_cases():
    from tllm.kernels.triton import kv_cache as m
    ptrs = {n: "*bf16" for n in ("k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr", "q_out_ptr",
                                 "q_ptr", "q_norm_ptr", "k_norm_ptr")}
    ptrs.update(cos_ptr="*fp32", sin_ptr="*fp32", slot_mapping_ptr="*i64",
                positions_ptr="*i64")
    for norm in (0, 1, 2):
        yield (f"rope_kv norm {norm}", m._write_kv_kernel, ptrs,
               ("k_scale", "v_scale", "eps"),
               dict(NUM_HEADS=32, NUM_KV_HEADS=4, HEAD_DIM=128, TOKENS_PER_BLOCK=16,
                    BLOCK_H=32, BLOCK_KVH=4, BLOCK_D=128, BLOCK_HALF=64, APPLY_ROPE=True,
                    KV_FP8=False, EMULATE=False, NORM=norm), 4, 2)


def gemv_cases():
    from tllm.kernels.triton import dense_gemv as m
    ptrs = {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16"}
    yield ("dense_gemv bias", m._dense_gemv_kernel, ptrs, (),
           dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, GATED=False, HAS_BIAS=True, EVEN_K=False,
                NUM_STAGES=2), 4, 2)


def chunk_cases():
    from tllm.kernels.triton import context_attention as c
    from tllm.kernels.triton import decode_attention as d
    ptrs = {n: "*bf16" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr",
                                 "sinks_ptr")}
    ptrs.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", block_tables_ptr="*i32",
                query_start_loc_ptr="*i32", seq_lens_ptr="*i32")
    floats = ("qk_scale", "soft_cap", "k_scale", "v_scale")
    for split in (False, True):
        yield (f"decode chunked split={split}", d._decode_attention_kernel, ptrs, floats,
               dict(GROUP=5, TOKENS_PER_BLOCK=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16,
                    BLOCK_N=64, USE_WINDOW=True, USE_CHUNK=True, IS_SPLIT=split,
                    PRECISION="tf32", DOT_FP32=False, SOFT_CAP=False, HAS_SINKS=False), 4, 2)
    yield ("context chunked", c._context_attention_kernel, ptrs, floats,
           dict(GROUP=5, TOKENS_PER_BLOCK=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128,
                BLOCK_N=128, USE_WINDOW=True, PRECISION="tf32", DOT_FP32=False,
                SOFT_CAP=False, HAS_SINKS=False, CAUSAL=True, USE_CHUNK=True), 8, 3)


def pair_sort_cases():
    """align_pairs' decode-sized launch (one chunk of 16 pairs, its own tile loop) and the
    counted form of a prefill's many chunks."""
    from tllm.kernels.triton import fused_moe as m
    ptrs = {n: "*i32" for n in ("sorted_ptr", "block_expert_ptr", "num_padded_ptr",
                                "chunk_counts_ptr", "topk_ids_ptr")}
    for chunk, tiles, counted in ((16, 16, False), (64, 64, True)):
        yield (f"place_pairs chunk {chunk}", m._place_pairs_kernel, ptrs, (),
               dict(NUM_EXPERTS=128, E_PAD=128, CHUNK=chunk, BLOCK_M=16, TILES=tiles,
                    COUNTED=counted), 4, 2)
    yield ("count_pairs", m._count_pairs_kernel, ptrs, (),
           dict(NUM_EXPERTS=128, E_PAD=128, CHUNK=64), 4, 2)


CASES = (moe_decode_cases, swiglu_decode_cases, kv_write_cases, gemv_cases, chunk_cases,
         pair_sort_cases)
NO_TOOLCHAIN = 3  # exit status: not even a trivial kernel compiles here (no verdict)


@triton.jit
def _trivial_kernel(x_ptr):
    triton.language.store(x_ptr, 1.0)


def toolchain_works() -> bool:
    try:
        compile_for_sm90(_trivial_kernel, {"x_ptr": "*fp32"}, (), {}, 1, 1)
    except Exception as exc:  # a missing or unrunnable ptxas, no sm_90 support
        print(f"no sm_90 toolchain here: {type(exc).__name__}: {str(exc)[:300]}")
        return False
    return True


def main(argv: list[str]) -> int:
    prefix = argv[0] if argv else ""
    if not toolchain_works():
        return NO_TOOLCHAIN
    failed = 0
    print(f"{'case':<34}{'regs':>6}{'spills':>8}{'smem':>8}")
    for cases in CASES:
        for label, kernel, ptrs, floats, constexprs, warps, stages in cases():
            if not label.startswith(prefix):
                continue
            try:
                compiled = compile_for_sm90(kernel, ptrs, floats, constexprs, warps, stages)
            except Exception as exc:  # the point of the script: report and go on
                failed += 1
                print(f"{label:<34}FAILED {type(exc).__name__}: {str(exc)[:300]}")
                continue
            spills = sum(1 for op, _ in sass_of(compiled) if op in ("LDL", "STL"))
            print(f"{label:<34}{registers(compiled):>6}{spills:>8}{compiled.metadata.shared:>8}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
