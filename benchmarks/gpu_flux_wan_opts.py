"""gpu_flux_wan.py's `teacache` and `fp8` parts (issue 39): our pipeline alone, whole
generations of the same prompt and seed, so each option's speed-up and PSNR are against our
own uncached BF16 output in the same run.

  teacache  the uncached generation, then one per TeaCache threshold (--flux-teacache,
            --wan-teacache: TeaCache's usual ones, FLUX 0.25 / 0.4 / 0.6, Wan 0.2): seconds,
            speed-up, steps skipped, PSNR of the image / all frames against the uncached one
  fp8       the same pipeline quantized in place (visual_gen.fp8.quantize_pipeline, as
            VisualGen(quantization="fp8") does at load), a 2-step warm-up (kernels compiled),
            then the generation: seconds, speed-up and PSNR against BF16 uncached

fp8 runs last: it swaps the transformer's linear layers for good."""
from __future__ import annotations

import time

import numpy as np
import torch

from tllm.visual_gen import VisualGenParams
from tllm.visual_gen.fp8 import quantize_pipeline

PROMPT = "A red fox runs through fresh snow in a pine forest at sunrise, highly detailed"
NEGATIVE = "blurry, low quality, static"
FLUX_GUIDANCE, WAN_GUIDANCE = 3.5, 5.0


def request(name: str, args, steps: int, **cache) -> VisualGenParams:
    """The request gpu_flux_wan.py's pipeline part times, as a VisualGenParams."""
    if name == "flux":
        height, width = args.flux_size
        return VisualGenParams(height=height, width=width, num_inference_steps=steps,
                               guidance_scale=FLUX_GUIDANCE, seed=0, **cache)
    height, width = args.wan_size
    return VisualGenParams(num_frames=args.wan_frames, height=height, width=width,
                           num_inference_steps=steps, guidance_scale=WAN_GUIDANCE,
                           negative_prompt=NEGATIVE, seed=0, **cache)


def generate(gen, name: str, args, device, steps: int | None = None, **cache) -> dict:
    """One timed generation: seconds, its pixels (uint8: the image, or every frame), the
    transformer steps the cache skipped."""
    steps = steps or (args.flux_steps if name == "flux" else args.wan_steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    out = gen.generate(PROMPT, request(name, args, steps, **cache))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    pixels = out.videos[0] if out.videos else np.asarray(out.images[0])
    return {"seconds": seconds, "pixels": np.asarray(pixels),
            "steps_skipped": (out.steps_skipped or [0])[0]}


def psnr(actual: np.ndarray, expected: np.ndarray) -> float:
    mse = ((actual.astype(np.float64) - expected.astype(np.float64)) ** 2).mean()
    return float("inf") if mse == 0 else float(10 * np.log10(255 ** 2 / mse))


def against(run: dict, reference: dict) -> dict:
    return {"seconds": run["seconds"], "speedup": reference["seconds"] / run["seconds"],
            "steps_skipped": run["steps_skipped"],
            "psnr_db": psnr(run["pixels"], reference["pixels"])}


def uncached(gen, name: str, args, device) -> dict:
    generate(gen, name, args, device, steps=2)           # warm-up: kernels, allocator
    reference = generate(gen, name, args, device)
    print(f"[{name}] uncached {args.dtype}: {reference['seconds']:.2f} s", flush=True)
    return reference


def part_teacache(gen, name: str, args, device, reference: dict) -> dict:
    thresholds = args.flux_teacache if name == "flux" else args.wan_teacache
    out = {"uncached_s": reference["seconds"]}
    for threshold in thresholds:
        run = generate(gen, name, args, device, cache="teacache", cache_threshold=threshold)
        out[f"teacache_{threshold}"] = result = against(run, reference)
        print(f"[{name}] TeaCache {threshold}: {result}", flush=True)
    return out


def part_fp8(gen, name: str, args, device, reference: dict) -> dict:
    started = time.perf_counter()
    layers = quantize_pipeline(gen.pipeline)
    quantize_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.empty_cache()                          # the BF16 weights just freed
    generate(gen, name, args, device, steps=2)            # warm-up: FP8 GEMMs compiled
    result = {"fp8_layers": layers, "quantize_s": quantize_s,
              **against(generate(gen, name, args, device), reference)}
    print(f"[{name}] FP8: {result}", flush=True)
    return result


def run_opts(gen, name: str, args, device) -> dict:
    """The parts of args.parts among teacache and fp8, for one family's VisualGen."""
    wanted = [p for p in ("teacache", "fp8") if p in args.parts]
    if not wanted:
        return {}
    reference = uncached(gen, name, args, device)
    out = {"size": _size(name, args), "steps": args.flux_steps if name == "flux"
           else args.wan_steps, "uncached_s": reference["seconds"]}
    for part in wanted:
        try:
            out[part] = (part_teacache if part == "teacache" else part_fp8)(
                gen, name, args, device, reference)
        except Exception as exc:  # one option's failure must not cost the other's figure
            out[part] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] {part} failed: {out[part]['error']}", flush=True)
    return out


def _size(name: str, args) -> str:
    if name == "flux":
        return f"{args.flux_size[1]}x{args.flux_size[0]}"
    return f"{args.wan_size[1]}x{args.wan_size[0]}x{args.wan_frames}"


def print_opts_table(results: dict, labels: dict[str, str]) -> None:
    """The options' markdown table, when any ran."""
    rows = [row for name, family in results["families"].items() if family.get("opts")
            for row in table_rows(labels[name], family["opts"])]
    if rows:
        print(f"\n| {results['device']}: ours, options | size | seconds | speed-up | "
              "steps skipped | PSNR vs uncached |\n|---|---|---|---|---|---|")
        print("\n".join(rows))


def table_rows(label: str, opts: dict) -> list[str]:
    """Markdown rows: each option's seconds, speed-up and PSNR against uncached BF16."""
    rows = [f"| {label}: uncached, {opts['steps']} steps + decode | {opts['size']} | "
            f"{opts['uncached_s']:.2f} | 1.00x | - | - |"]
    for key, r in (opts.get("teacache") or {}).items():
        if key.startswith("teacache_"):
            rows.append(f"| {label}: TeaCache {key.removeprefix('teacache_')} | {opts['size']}"
                        f" | {r['seconds']:.2f} | {r['speedup']:.2f}x | {r['steps_skipped']} | "
                        f"{r['psnr_db']:.1f} dB |")
    fp8 = opts.get("fp8")
    if fp8 and "error" not in fp8:
        rows.append(f"| {label}: FP8 ({fp8['fp8_layers']} linears) | {opts['size']} | "
                    f"{fp8['seconds']:.2f} | {fp8['speedup']:.2f}x | - | {fp8['psnr_db']:.1f} dB |")
    for part in ("teacache", "fp8"):
        if "error" in (opts.get(part) or {}):
            rows.append(f"| {label}: {part} failed: {opts[part]['error'][:120]} | | | | | |")
    return rows
