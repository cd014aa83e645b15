"""Whole-pipeline seconds of Qwen-Image text-to-image with true CFG: ours (`VisualGen`) against
diffusers' own QwenImagePipeline assembled from the very same component objects (tokenizer, text
encoder, VAE, scheduler config) and a QwenImageTransformer2DModel on views of our transformer's
weights (as benchmarks/visual_gen_transformer.py builds it), so memory holds one copy.

Each pipeline: one warm-up call (--warmup-steps steps: the same shapes, so the same kernels,
autotuning and allocator state), then --runs timed calls of --steps steps; median seconds, with
the device synchronized around each call. Every call is split into encode (tokenize, text
encoder, noise and schedule; plus the input image's VAE encoding for the layered model) /
denoise / decode (VAE decode and PIL conversion) by forward pre-hooks on the same modules of both
pipelines: denoising starts at the transformer's first forward, decoding at the VAE's
post_quant_conv (the first op of its decode); the device is synchronized at each mark. The
transformer hook also counts the rows it is run on, to check both pipelines run --steps steps
with CFG (2 rows a step). Peak memory is torch.cuda.max_memory_allocated over a call, weights
included. Images are compared by decoding both final latents with the same VAE (and as 8-bit
PIL images, each pipeline's own decode). With --layered, Qwen-Image-Layered (4 layers, 640
bucket, an input image) is timed too, ours alone.

    python benchmarks/visual_gen_pipeline.py --layered --out pipeline.json          # H200
    python benchmarks/visual_gen_pipeline.py --tiny auto --device cpu --dtype float32 \\
        --steps 3 --height 64 --width 64 --layered                                  # CPU check

Prints a markdown table last; writes every number as JSON to --out. Exits 1 if a check fails."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.visual_gen_transformer import build_diffusers
from tllm.visual_gen import VisualGen, VisualGenParams

PROMPT = ("A photo of a cat holding a sign that says hello world, in a city street at night "
          "with neon lights, highly detailed")
NEGATIVE_PROMPT = "blurry, low quality"
TRUE_CFG_SCALE = 4.0
LAYERS, RESOLUTION = 4, 640
FP32_IMAGE_TOL = 1e-3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:qwen-image")
    p.add_argument("--layered-model", default="dummy:qwen-image-layered")
    p.add_argument("--layered", action="store_true", help="also time the layered model (ours)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--skip-diffusers", action="store_true")
    p.add_argument("--tiny", metavar="PATH_OR_auto",
                   help="tiny diffusers folders (built under PATH if missing; auto: a temp "
                        "dir) instead of --model / --layered-model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if min(args.steps, args.warmup_steps, args.runs) <= 0:
        p.error("--steps, --warmup-steps and --runs must be positive")
    if args.tiny:
        args.model, args.layered_model = tiny_model_dirs(args.tiny, args.layered)
    return args


def tiny_model_dirs(where: str, layered: bool) -> tuple[str, str]:
    from tests.visual_gen.tiny_models import save_tiny_model
    root = Path(tempfile.mkdtemp(prefix="tiny_qwen_") if where == "auto" else where)
    dirs = root / "qwen-image", root / "qwen-image-layered"
    for path, is_layered in zip(dirs, (False, True)):
        if (layered or not is_layered) and not (path / "model_index.json").is_file():
            save_tiny_model(path, layered=is_layered)
    return str(dirs[0]), str(dirs[1])


class PhaseClock:
    """Times one pipeline call split at module forward pre-hooks (see the module docstring),
    counts the transformer's rows and reads peak memory."""

    def __init__(self, transformer: torch.nn.Module, vae: torch.nn.Module,
                 device: torch.device) -> None:
        self.device, self.marks, self.rows = device, {}, 0
        self.handles = [transformer.register_forward_pre_hook(self._on_transformer,
                                                              with_kwargs=True),
                        vae.post_quant_conv.register_forward_pre_hook(self._on_decode)]

    def start(self) -> None:
        self.marks, self.rows = {}, 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._mark("start")

    def stop(self) -> dict:
        self._mark("end")
        t = self.marks
        peak = (torch.cuda.max_memory_allocated(self.device) / 2**30
                if self.device.type == "cuda" else None)
        return {"total_s": t["end"] - t["start"], "encode_s": t["denoise"] - t["start"],
                "denoise_s": t["decode"] - t["denoise"], "decode_s": t["end"] - t["decode"],
                "peak_gib": peak, "transformer_rows": self.rows}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _on_transformer(self, module, args, kwargs) -> None:
        self._mark("denoise")
        self.rows += kwargs["hidden_states"].shape[0]

    def _on_decode(self, module, args) -> None:
        self._mark("decode")

    def _mark(self, name: str) -> None:
        if name not in self.marks:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.marks[name] = time.perf_counter()


def measure(run, clock: PhaseClock, args) -> tuple[dict, tuple]:
    """Warm up, then time --runs calls of run(steps) -> (images, latents); the summary and
    the last call's result."""
    run(args.warmup_steps)
    records = []
    for _ in range(args.runs):
        clock.start()
        result = run(args.steps)
        records.append(clock.stop())
    summary = {key: statistics.median(r[key] for r in records)
               for key in ("total_s", "encode_s", "denoise_s", "decode_s")}
    peaks = [r["peak_gib"] for r in records if r["peak_gib"] is not None]
    summary.update(times_s=[r["total_s"] for r in records], peak_gib=max(peaks, default=None),
                   transformer_rows=[r["transformer_rows"] for r in records],
                   rows_ok=all(r["transformer_rows"] == 2 * args.steps for r in records),
                   finite=bool(torch.isfinite(result[1]).all()))
    return summary, result


def ours_runner(gen: VisualGen, args, image=None, **size):
    def run(steps: int):
        params = VisualGenParams(num_inference_steps=steps, negative_prompt=NEGATIVE_PROMPT,
                                 true_cfg_scale=TRUE_CFG_SCALE, seed=args.seed,
                                 return_latents=True, **size)
        out = gen.generate(PROMPT, params, image=image)
        return out.images, out.latents
    return run


def diffusers_pipeline(gen: VisualGen):
    """diffusers' QwenImagePipeline on our pipeline's component objects; its transformer on
    views of ours."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    ours = gen.pipeline
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        dataclasses.asdict(ours.scheduler_config))
    pipe = QwenImagePipeline(scheduler=scheduler, vae=ours.vae, text_encoder=ours.text_encoder,
                             tokenizer=ours.tokenizer, transformer=build_diffusers(
                                 ours.transformer))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_runner(pipe, args):
    def run(steps: int):
        seen = {}

        def keep_latents(_, index, timestep, tensors):
            seen["latents"] = tensors["latents"]
            return {}
        images = pipe(PROMPT, negative_prompt=NEGATIVE_PROMPT, true_cfg_scale=TRUE_CFG_SCALE,
                      height=args.height, width=args.width, num_inference_steps=steps,
                      generator=torch.Generator("cpu").manual_seed(args.seed),
                      callback_on_step_end=keep_latents).images
        return images, seen["latents"]
    return run


def image_difference(gen: VisualGen, ours: tuple, theirs: tuple, args) -> dict:
    """Max abs difference of both final latents decoded by the same VAE (floats in [0, 1]),
    and of the pipelines' own 8-bit images (levels)."""
    decoded = [gen.pipeline.decode(latents, args.height, args.width).float()
               for latents in (ours[1], theirs[1])]
    pixels = [np.asarray(images[0]).astype(np.int16) for images in (ours[0], theirs[0])]
    return {"decoded_max_abs_diff": float((decoded[0] - decoded[1]).abs().max()),
            "pil_max_abs_diff_levels": int(np.abs(pixels[0] - pixels[1]).max())}


def compare_pipelines(args, results: dict) -> None:
    """Ours, then diffusers' on the same components (unless --skip-diffusers)."""
    gen = VisualGen(args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                    show_progress=False)
    pipeline = gen.pipeline
    clock = PhaseClock(pipeline.transformer, pipeline.vae, gen.device)
    results["runs"]["ours"], ours_out = measure(ours_runner(
        gen, args, height=args.height, width=args.width), clock, args)
    clock.remove()
    if args.skip_diffusers:
        return
    pipe = diffusers_pipeline(gen)
    clock = PhaseClock(pipe.transformer, pipe.vae, gen.device)
    results["runs"]["diffusers"], their_out = measure(diffusers_runner(pipe, args), clock, args)
    clock.remove()
    results["images"] = image_difference(gen, ours_out, their_out, args)


def time_layered(args, results: dict) -> None:
    from PIL import Image
    gen = VisualGen(args.layered_model, dtype=args.dtype, device=args.device, seed=args.seed,
                    show_progress=False)
    pixels = np.random.RandomState(args.seed).randint(0, 256, (1024, 1024, 4), dtype=np.uint8)
    clock = PhaseClock(gen.pipeline.transformer, gen.pipeline.vae, gen.device)
    results["runs"]["ours, layered"], _ = measure(ours_runner(
        gen, args, image=Image.fromarray(pixels), layers=LAYERS, resolution=RESOLUTION),
        clock, args)
    clock.remove()


def main() -> int:
    args = parse_args()
    import diffusers
    device = torch.device(args.device)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {},
               "torch": torch.__version__, "diffusers": diffusers.__version__,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    compare_pipelines(args, results)
    _save(results, args)    # again after each part: a later one may run out of time
    _free_memory(device)
    if args.layered:
        time_layered(args, results)
    ok = _check(results, args)
    _save(results, args)
    _print_table(results, args)
    return 0 if ok else 1


def _save(results: dict, args) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _check(results: dict, args) -> bool:
    """Every call ran --steps steps with CFG, final latents finite; in float32, ours and
    diffusers' images match."""
    ok = all(run["rows_ok"] and run["finite"] for run in results["runs"].values())
    if "images" in results and args.dtype == "float32":
        ok = ok and results["images"]["decoded_max_abs_diff"] <= FP32_IMAGE_TOL
    results["ok"] = ok
    return ok


def _print_table(results: dict, args) -> None:
    print(f"\nQwen-Image pipeline, {args.model}, {args.height}x{args.width}, {args.steps} steps, "
          f"true CFG {TRUE_CFG_SCALE}, {args.dtype} on {results['device']}; median of "
          f"{args.runs} runs after a {args.warmup_steps}-step warm-up; layered: {LAYERS} "
          f"layers, {RESOLUTION} bucket")
    for name, run in results["runs"].items():
        print(f"{name}: transformer rows per call {run['transformer_rows']} (expected "
              f"{2 * args.steps}: {'ok' if run['rows_ok'] else 'FAIL'})")
    if "images" in results:
        img = results["images"]
        print(f"images, ours vs diffusers: decoded max abs diff {img['decoded_max_abs_diff']:.2e}"
              f", 8-bit max diff {img['pil_max_abs_diff_levels']} levels"
              + ("" if args.dtype == "float32" else " (low-precision drift; informative)"))
    base = results["runs"].get("diffusers")
    print("\n| pipeline | total s | encode s | denoise s | decode s | ms / step | peak GiB "
          "| vs diffusers |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, run in results["runs"].items():
        speedup = (f"{base['total_s'] / run['total_s']:.2f}x"
                   if base and "layered" not in name else "-")
        peak = f"{run['peak_gib']:.1f}" if run["peak_gib"] is not None else "-"
        print(f"| {name} | {run['total_s']:.2f} | {run['encode_s']:.2f} | "
              f"{run['denoise_s']:.2f} | {run['decode_s']:.2f} | "
              f"{1e3 * run['denoise_s'] / args.steps:.0f} | {peak} | {speedup} |")


if __name__ == "__main__":
    sys.exit(main())
