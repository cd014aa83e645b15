"""Cosmos 3 on the GPU: per-step transformer time at the model's default video size and
whole-pipeline seconds, ours against diffusers on the same weights in the same process.

Ours is `VisualGen("dummy:cosmos")` (random weights in Cosmos3-Nano's shapes: 36 MoT layers,
hidden 4096, the Wan 2.2 VAE). diffusers' side is its Cosmos3OmniTransformer holding a copy of
our weights (`DiffusersCosmos3.from_ours`) and, for the pipeline, its Cosmos3OmniPipeline
assembled from that transformer and our very tokenizer and VAE objects, with a
UniPCMultistepScheduler of our scheduler's config.

1. check: one guided step's predictions, ours vs diffusers (bf16 relative error).
2. step: one guided denoising step of the transformer (ours: both branches in one forward;
   diffusers: two forwards, as its pipeline calls it) at --height x --width x --frames
   (default 720 x 1280 x 189, diffusers' default: 48 x 45 x 80 latents, 44,160 video tokens a
   branch); --warmup then --runs timed steps, median.
3. pipeline: text to video end to end (tokenize, noise, --pipe-steps UniPC steps with CFG,
   VAE decode to frames) at --pipe-height x --pipe-width x --pipe-frames (default 480 x 832 x
   61, 10 steps: the default size and 35 steps take minutes a run); one warm-up run of 2 steps,
   then one timed run each; final latents compared.

    python benchmarks/gpu_video.py --out gpu_video.json                      # H200, ~5 min
    python benchmarks/gpu_video.py --tiny --device cpu --dtype float32       # CPU smoke test

`--family ltx2` runs the LTX-2 section instead (benchmarks/gpu_video_ltx2.py says what it
measures; --ltx-height/--ltx-width/--ltx-frames/--ltx-pipe-steps set its sizes).

Prints a markdown table last; writes the numbers as JSON to --out (or $OUT/gpu_video.json)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from tllm.visual_gen import VisualGen, VisualGenParams
from tllm.visual_gen.models.cosmos3.diffusers_transformer import DiffusersCosmos3
from tllm.visual_gen.models.cosmos3.pipeline import VideoRequest
from tllm.visual_gen.models.cosmos3.transformer import GenTokens

PROMPT = "A robot arm picks up a red cube from a wooden table, soft daylight, detailed"
NEGATIVE = "blurry, low quality"
GUIDANCE = 6.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="cosmos", choices=["cosmos", "ltx2"])
    p.add_argument("--model", default="dummy:cosmos")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--frames", type=int, default=189)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--pipe-height", type=int, default=480)
    p.add_argument("--pipe-width", type=int, default=832)
    p.add_argument("--pipe-frames", type=int, default=61)
    p.add_argument("--pipe-steps", type=int, default=10)
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument("--out", type=Path)
    for name in ("height", "width", "frames", "pipe-steps"):
        p.add_argument(f"--ltx-{name}", type=int, help="LTX-2 section (default: its own)")
    args = p.parse_args()
    if args.tiny and args.family == "cosmos":
        from tests.visual_gen.tiny_cosmos import save_tiny_cosmos
        args.model = str(save_tiny_cosmos(Path(tempfile.mkdtemp(prefix="tiny_cosmos_"))))
        args.height, args.width, args.frames = 48, 64, 9
        args.pipe_height, args.pipe_width, args.pipe_frames, args.pipe_steps = 32, 48, 5, 3
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int, runs: int) -> tuple[float, list[float], object]:
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def step_inputs(pipeline, height: int, width: int, frames: int, device):
    """One guided step's inputs at this size: random latents, [uncond, cond] layouts."""
    request = VideoRequest.resolve(VisualGenParams(num_frames=frames, height=height,
                                                   width=width, negative_prompt=NEGATIVE,
                                                   guidance_scale=GUIDANCE))
    shape = (pipeline.vae.config.z_dim, (frames - 1) // pipeline.temporal + 1,
             height // pipeline.spatial, width // pipeline.spatial)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    layouts = [pipeline.layout(ids, shape[1:], request)
               for ids in pipeline.prompt_ids(PROMPT, request)]
    gen = GenTokens(latents.to(pipeline.transformer.dtype), None, list(range(shape[1])))
    return gen, layouts


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def bench_step(pipeline, theirs, args, device) -> dict:
    ours = pipeline.transformer
    gen, layouts = step_inputs(pipeline, args.height, args.width, args.frames, device)
    tokens = gen.vision.shape[1] * -(-gen.vision.shape[2] // 2) * -(-gen.vision.shape[3] // 2)
    ours_s, ours_all, ours_out = timed(lambda: ours(gen, 999, layouts)[0], device,
                                       args.warmup, args.runs)
    try:
        theirs_s, theirs_all, theirs_out = timed(lambda: theirs(gen, 999, layouts)[0], device,
                                                 args.warmup, args.runs)
    except torch.OutOfMemoryError as exc:   # e.g. SDPA's math fallback for GQA
        print(f"diffusers' step ran out of memory: {exc}", file=sys.stderr)
        theirs_s, theirs_all, theirs_out = float("nan"), [], ours_out
    return {"size": f"{args.width}x{args.height}x{args.frames}", "video_tokens": tokens,
            "text_tokens": [layout.und_len for layout in layouts],
            "ours_s": ours_s, "diffusers_s": theirs_s, "ours_runs": ours_all,
            "diffusers_runs": theirs_all, "speedup": theirs_s / ours_s,
            "rel_error": relative(ours_out, theirs_out)}


def diffusers_pipeline(pipeline, theirs):
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
    config = pipeline.scheduler_config
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=config.flow_shift,
        solver_order=config.solver_order, solver_type=config.solver_type,
        num_train_timesteps=config.num_train_timesteps)
    pipe = Cosmos3OmniPipeline(transformer=theirs.model, text_tokenizer=pipeline.tokenizer,
                               vae=pipeline.vae, scheduler=scheduler,
                               enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def bench_pipeline(gen, theirs, args, device) -> dict:
    pipe = diffusers_pipeline(gen.pipeline, theirs)
    size = dict(num_frames=args.pipe_frames, height=args.pipe_height, width=args.pipe_width)
    seen = {}

    def keep(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    def run_ours(steps):
        params = VisualGenParams(**size, num_inference_steps=steps, guidance_scale=GUIDANCE,
                                 negative_prompt=NEGATIVE, seed=0, return_latents=True)
        return gen.generate(PROMPT, params).latents

    def run_theirs(steps):
        pipe(prompt=PROMPT, negative_prompt=NEGATIVE, **size, num_inference_steps=steps,
             guidance_scale=GUIDANCE, generator=torch.Generator().manual_seed(0),
             output_type="np", callback_on_step_end=keep, enable_safety_check=False)
        return seen["latents"]

    run_ours(2), run_theirs(2)
    ours_s, _, ours_latents = timed(lambda: run_ours(args.pipe_steps), device, 0, 1)
    theirs_s, _, theirs_latents = timed(lambda: run_theirs(args.pipe_steps), device, 0, 1)
    return {"size": f"{args.pipe_width}x{args.pipe_height}x{args.pipe_frames}",
            "steps": args.pipe_steps, "ours_s": ours_s, "diffusers_s": theirs_s,
            "speedup": theirs_s / ours_s,
            "latents_rel_error": relative(ours_latents, theirs_latents)}


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if args.family == "ltx2":
        return run_ltx2(args, device)
    start = time.perf_counter()
    gen = VisualGen(args.model, dtype=args.dtype, device=args.device, show_progress=False)
    theirs = DiffusersCosmos3.from_ours(gen.pipeline.transformer)
    build_s = time.perf_counter() - start
    print(f"built ours + diffusers' copy in {build_s:.1f} s", file=sys.stderr)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "model": args.model, "build_s": build_s}
    results["step"] = bench_step(gen.pipeline, theirs, args, device)
    print(json.dumps(results["step"]), file=sys.stderr)
    if not args.skip_pipeline:
        results["pipeline"] = bench_pipeline(gen, theirs, args, device)
        print(json.dumps(results["pipeline"]), file=sys.stderr)
    out = args.out or (Path(os.environ["OUT"]) / "gpu_video.json" if "OUT" in os.environ
                       else None)
    if out is not None:
        out.write_text(json.dumps(results, indent=2))
    step = results["step"]
    print(f"\n| Cosmos 3 ({results['device']}, {args.dtype}) | size | ours s | diffusers s | "
          f"speed-up | rel. error |\n|---|---|---|---|---|---|")
    print(f"| transformer, one CFG step ({step['video_tokens']} video tokens) | {step['size']} "
          f"| {step['ours_s']:.3f} | {step['diffusers_s']:.3f} | {step['speedup']:.2f}x | "
          f"{step['rel_error']:.2e} |")
    if "pipeline" in results:
        pipe = results["pipeline"]
        print(f"| whole pipeline, {pipe['steps']} steps + VAE decode | {pipe['size']} | "
              f"{pipe['ours_s']:.2f} | {pipe['diffusers_s']:.2f} | {pipe['speedup']:.2f}x | "
              f"{pipe['latents_rel_error']:.2e} |")
    return 0


def run_ltx2(args, device: torch.device) -> int:
    import gpu_video_ltx2
    results = gpu_video_ltx2.run(args, device, timed, relative)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results.update(device=name, dtype=args.dtype)
    out = args.out or (Path(os.environ["OUT"]) / "gpu_video_ltx2.json" if "OUT" in os.environ
                       else None)
    if out is not None:
        out.write_text(json.dumps(results, indent=2))
    gpu_video_ltx2.print_table(results, name, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
