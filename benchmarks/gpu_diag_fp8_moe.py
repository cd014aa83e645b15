"""Diagnosis of the FP8 experts on a GPU: each scale scheme's Triton path against the torch
emulation, eager and captured in a CUDA graph (a failed capture prints its traceback).

    python benchmarks/gpu_diag_fp8_moe.py"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tllm.kernels import fp8 as ref  # noqa: E402
from tllm.kernels.fp8_moe import Fp8Experts, fp8_fused_experts, fp8_fused_experts_ref  # noqa
from tllm.kernels.moe_routing import MoeRouting, route_experts  # noqa: E402

E, H, I, TOP_K = 8, 256, 256, 2


def experts(scheme: str, device) -> Fp8Experts:
    parts = {"w13": [], "s13": [], "w2": [], "s2": []}
    for _ in range(E):
        for name, shape in (("13", (2 * I, H)), ("2", (H, I))):
            w = torch.randn(*shape) / shape[1] ** 0.5
            q, s = (ref.quantize_blocks(w, (128, 128)) if scheme == "block"
                    else ref.quantize_per_channel(w))
            parts["w" + name].append(q)
            parts["s" + name].append(s)
    t = {k: torch.stack(v).to(device) for k, v in parts.items()}
    return Fp8Experts(t["w13"], t["s13"], t["w2"], t["s2"],
                      (128, 128) if scheme == "block" else None)


def main() -> None:
    device = torch.device("cuda")
    for scheme in ("channel", "block"):
        ex = experts(scheme, device)
        for tokens in (1, 8, 64):
            hidden = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
            logits = torch.randn(tokens, E, device=device)
            weights, ids = route_experts(logits, MoeRouting(TOP_K, renormalize=True))
            label = f"{scheme} T={tokens}"
            try:
                eager = fp8_fused_experts(hidden, ex, weights, ids)
                cpu = Fp8Experts(*(t.cpu() for t in (ex.w13, ex.w13_scale, ex.w2,
                                                      ex.w2_scale)), ex.block)
                want = fp8_fused_experts_ref(hidden.cpu(), cpu, weights.cpu(), ids.cpu())
                err = ((eager.float().cpu() - want.float()).norm() / want.float().norm())
                print(f"{label}: eager ok, rel. error against the emulation {err:.2e}",
                      flush=True)
            except Exception:
                print(f"{label}: eager FAILED", flush=True)
                traceback.print_exc()
                continue
            graph = torch.cuda.CUDAGraph()
            try:
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    out = fp8_fused_experts(hidden, ex, weights, ids)
                graph.replay()
                torch.cuda.synchronize()
                print(f"{label}: captured, replay == eager: {torch.equal(out, eager)}",
                      flush=True)
            except Exception:
                print(f"{label}: capture FAILED", flush=True)
                traceback.print_exc()
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
