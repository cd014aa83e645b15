"""The GGUF kernels compiled for sm_90 on a machine without a GPU (Triton's bundled ptxas and
cuobjdump): that each lowers, its registers and stack, and the instructions of its K loop per
weight value a thread handles (SASS in /tmp/c2b/asm). A static count, not a timing.

    python benchmarks/gguf_sass_count.py gemv 5,7,4 4x16x1,8x32x2   # QTYPE codes, BNxBGxwarps
    python benchmarks/gguf_sass_count.py mm 0,5,7
"""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tllm.kernels.triton import gguf_gemm as G

EXTRA_UNDIV = []
target = GPUTarget("cuda", 90, 32)

def sig_of(kernel, types, constexprs):
    names = kernel.arg_names
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        else:
            sig[n] = types(n)
    return sig

def ptr_types(n):
    if n.endswith("_ptr"):
        return {"out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "x_ptr": "*bf16",
                "qs_ptr": "*u8", "qh_ptr": "*i32", "d_ptr": "*fp16", "dmin_ptr": "*fp16",
                "sc_ptr": "*u8", "m_ptr": "*u8"}[n]
    return "i32"

def compile_one(kernel, constexprs, num_warps, num_stages, qtype):
    def types(n):
        t = ptr_types(n)
        if qtype == 4 and n == "qs_ptr": return "*i8"
        if qtype == 7 and n == "sc_ptr": return "*i8"
        if qtype in (1, 3) and n == "m_ptr": return "*fp16"
        return t
    undiv = {"s_d", "s_dmin", "groups_per_split", "M"} | set(EXTRA_UNDIV)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in constexprs and n not in undiv}
    src = ASTSource(kernel, sig_of(kernel, types, constexprs), constexprs, attrs)
    k = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    return k

TILES = [tuple(map(int, t.split("x"))) for t in (sys.argv[3] if len(sys.argv) > 3 else "8x16x2").split(",")]
import subprocess, os, re, collections
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin") + "/"

def stats(k, tag):
    os.makedirs("/tmp/c2b/asm", exist_ok=True)
    cub = f"/tmp/c2b/asm/{tag}.cubin"
    open(cub, "wb").write(k.asm["cubin"])
    open(f"/tmp/c2b/asm/{tag}.ttgir", "w").write(k.asm["ttgir"])
    res = subprocess.run([BIN + "cuobjdump", "-res-usage", cub], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res); stack = re.search(r"STACK:(\d+)", res); shared = re.search(r"SHARED:(\d+)", res)
    sass = subprocess.run([BIN + "cuobjdump", "-sass", cub], capture_output=True, text=True).stdout
    open(f"/tmp/c2b/asm/{tag}.sass", "w").write(sass)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m: ops[m.group(2).split(".")[0]] += 1
    return f"regs {regs and regs.group(1)} stack {stack and stack.group(1)} smem {shared and shared.group(1)} instrs {sum(ops.values())} top {ops.most_common(8)}"

def loop_stats(tag, values_per_thread):
    lines = open(f"/tmp/c2b/asm/{tag}.sass").read().splitlines()
    ins = []
    for l in lines:
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", l)
        if m: ins.append((int(m.group(1), 16), m.group(2)))
    best = None
    for addr, txt in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            n = sum(1 for a, _ in ins if int(m.group(1), 16) <= a <= addr)
            best = max(best or 0, n)
    bars = sum(1 for _, t in ins if "BAR" in t)
    return f"| loop {best} instrs, {best / values_per_thread:.2f} per value; BARs {bars}" if best else "| no loop"

if __name__ == "__main__":
    which = sys.argv[1]
    for q in map(int, sys.argv[2].split(",")):
        if which == "gemv":
            for bn, bg, w in TILES:
                c = dict(QTYPE=q, BLOCK_N=bn, BLOCK_G=bg, SPLIT=0, BROADCAST_X=16 * bg < 256 * w)
                k = compile_one(G._gguf_gemv_kernel, c, w, 3, q)
                tag = f"gemv_{q}_{bn}_{bg}_{w}"
                print(tag, stats(k, tag), loop_stats(tag, 2 * bn * bg * 16 / (32 * w)), flush=True)
        else:
            for kern, name, bg, st in ((G._gguf_mm_kernel, "mm", 2, 3), (G._gguf_mm_tile_kernel, "tile", 4, 2)):
                c = dict(QTYPE=q, BLOCK_M=32, BLOCK_N=64, BLOCK_G=bg, SPLIT=2, DOT_FP32=False, PRECISION="tf32")
                k = compile_one(kern, c, 4, st, q)
                print(name, q, stats(k, f"{name}_{q}"), flush=True)
