"""FLUX.1-dev and Wan 2.2 TI2V-5B on the GPU: per-step transformer time and whole-pipeline
seconds, ours against diffusers on the same weights in the same process.

Ours is `VisualGen("dummy:flux.1-dev")` / `VisualGen("dummy:wan2.2-ti2v-5b")` (random weights
in the real shapes: the 12B FLUX transformer with T5-XXL and CLIP-L; the 5B Wan transformer
with UMT5-XXL and the Wan 2.2 VAE). diffusers' side is its FluxTransformer2DModel /
WanTransformer3DModel on views of our weights (no second copy) inside its FluxPipeline /
WanPipeline assembled from our very tokenizer, text encoder and VAE objects, with a
scheduler of our scheduler's config.

1. step: one denoising step of the transformer at the pipeline's size: FLUX.1-dev one
   forward (guidance-distilled, no CFG); Wan one CFG step (ours: both branches in one
   forward; diffusers: two forwards, as its pipeline calls it, with one timestep per row where
   its TI2V pipeline passes one per token). --warmup then --runs, median.
2. pipeline: text to image / video end to end (text encoders, noise, the steps, VAE decode):
   FLUX.1-dev 1024x1024, 28 steps, guidance 3.5; Wan 704x1280 (720p), --wan-frames frames,
   --wan-steps UniPC steps with CFG 5 (default 20: the 50 of diffusers' default take twice as
   long and change no ratio). One warm-up run of 2 steps, then one timed run each; the final
   latents compared (bf16 relative error).

    python benchmarks/gpu_flux_wan.py --out gpu_flux_wan.json               # H200
    python benchmarks/gpu_flux_wan.py --tiny --device cpu --dtype float32  # CPU smoke test

--models flux or --models wan runs one family (e.g. one per call where a call's time is
short: each builds its random weights on the GPU, then times both sides).

--parts picks what runs (default step,pipeline: the above); `teacache` and `fp8`
(gpu_flux_wan_opts.py) time our pipeline alone with TeaCache at its usual thresholds and
with `quantization="fp8"`, speed-up and PSNR against our uncached BF16 output of the same
seed; diffusers is built only for step and pipeline:

    python benchmarks/gpu_flux_wan.py --parts teacache,fp8                   # issue 39

Prints a markdown table last; writes the numbers as JSON to --out (or $OUT/gpu_flux_wan.json,
default /tmp/gpu_flux_wan/)."""
from __future__ import annotations

import argparse
import dataclasses
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

from gpu_flux_wan_opts import (FLUX_GUIDANCE, NEGATIVE, PROMPT, WAN_GUIDANCE,  # noqa: E402
                               print_opts_table, run_opts)
from tllm.visual_gen import VisualGen, VisualGenParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="flux,wan", help="comma-separated: flux, wan")
    p.add_argument("--flux-model", default="dummy:flux.1-dev")
    p.add_argument("--wan-model", default="dummy:wan2.2-ti2v-5b")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random folders")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--flux-size", type=int, nargs=2, default=(1024, 1024), metavar=("H", "W"))
    p.add_argument("--flux-steps", type=int, default=28)
    p.add_argument("--wan-size", type=int, nargs=2, default=(704, 1280), metavar=("H", "W"))
    p.add_argument("--wan-frames", type=int, default=121)
    p.add_argument("--wan-steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--parts", default="step,pipeline",
                   help="comma-separated: step, pipeline, teacache, fp8")
    p.add_argument("--skip-pipeline", action="store_true", help="--parts without pipeline")
    p.add_argument("--flux-teacache", default="0.25,0.4,0.6", help="TeaCache thresholds")
    p.add_argument("--wan-teacache", default="0.2", help="TeaCache thresholds")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()} - (
        {"pipeline"} if args.skip_pipeline else set())
    if args.parts - {"step", "pipeline", "teacache", "fp8"}:
        p.error(f"--parts: unknown {sorted(args.parts)}")
    args.flux_teacache = [float(x) for x in args.flux_teacache.split(",")]
    args.wan_teacache = [float(x) for x in args.wan_teacache.split(",")]
    if args.tiny:
        from tests.visual_gen.tiny_flux import save_tiny_flux
        from tests.visual_gen.tiny_wan import save_tiny_wan
        root = Path(tempfile.mkdtemp(prefix="tiny_flux_wan_"))
        args.flux_model = str(save_tiny_flux(root / "flux"))
        args.wan_model = str(save_tiny_wan(root / "wan", "dense"))
        args.flux_size, args.flux_steps = (32, 48), 3
        args.wan_size, args.wan_frames, args.wan_steps = (32, 64), 5, 3
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int, runs: int):
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


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def on_our_weights(model_cls, config: dict, ours) -> torch.nn.Module:
    """diffusers' model_cls(**config) holding views of our transformer's weights."""
    with torch.device("meta"):
        model = model_cls(**config)
    names = list(model.state_dict())
    model.load_state_dict(ours.diffusers_state_dict(names), assign=True, strict=True)
    return model.eval()


# ---- FLUX.1 ----

def flux_reference(pipeline):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    config = {k: (list(v) if isinstance(v, tuple) else v)
              for k, v in dataclasses.asdict(pipeline.transformer.config).items()}
    theirs = on_our_weights(FluxTransformer2DModel, config, pipeline.transformer)
    scheduler = FlowMatchEulerDiscreteScheduler(**dataclasses.asdict(pipeline.scheduler_config))
    pipe = FluxPipeline(scheduler=scheduler, vae=pipeline.vae,
                        text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer,
                        text_encoder_2=pipeline.text_encoder_2,
                        tokenizer_2=pipeline.tokenizer_2, transformer=theirs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def flux_step(gen, pipe, args, device) -> dict:
    pipeline = gen.pipeline
    height, width = args.flux_size
    rows, cols = height // pipeline.size_multiple, width // pipeline.size_multiple
    dtype = pipeline.transformer.dtype
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, rows * cols, pipeline.transformer.config.in_channels,
                          generator=generator).to(device, dtype)
    states, pooled = pipeline.encode_prompts([PROMPT])
    img_ids, txt_ids = pipeline.image_ids(rows, cols), torch.zeros(states.shape[1], 3,
                                                                  device=device, dtype=dtype)
    t, guidance = torch.tensor([0.9], device=device), torch.tensor([FLUX_GUIDANCE],
                                                                   device=device)
    ours_s, ours_all, ours_out = timed(
        lambda: pipeline.transformer(latents, states, pooled, t, img_ids, txt_ids, guidance),
        device, args.warmup, args.runs)
    theirs_s, theirs_all, theirs_out = timed(
        lambda: pipe.transformer(hidden_states=latents, encoder_hidden_states=states,
                                 pooled_projections=pooled, timestep=t, img_ids=img_ids,
                                 txt_ids=txt_ids, guidance=guidance, return_dict=False)[0],
        device, args.warmup, args.runs)
    return {"size": f"{width}x{height}", "image_tokens": rows * cols,
            "text_tokens": states.shape[1], "ours_s": ours_s, "diffusers_s": theirs_s,
            "ours_runs": ours_all, "diffusers_runs": theirs_all,
            "speedup": theirs_s / ours_s, "rel_error": relative(ours_out, theirs_out)}


@torch.no_grad()
def flux_pipeline(gen, pipe, args, device) -> dict:
    height, width = args.flux_size
    seen = {}

    def keep(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    def run_ours(steps):
        return gen.generate(PROMPT, VisualGenParams(
            height=height, width=width, num_inference_steps=steps, guidance_scale=FLUX_GUIDANCE,
            seed=0, return_latents=True)).latents

    def run_theirs(steps):
        pipe(PROMPT, height=height, width=width, num_inference_steps=steps,
             guidance_scale=FLUX_GUIDANCE, generator=torch.Generator().manual_seed(0),
             output_type="pil", callback_on_step_end=keep)
        return seen["latents"]

    return compare_pipelines(run_ours, run_theirs, args.flux_steps, device,
                             f"{width}x{height}")


# ---- Wan ----

def wan_reference(pipeline):
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    def theirs(ours):
        if ours is None:
            return None
        config = {k: (list(v) if isinstance(v, tuple) else v)
                  for k, v in dataclasses.asdict(ours.config).items()}
        model = on_our_weights(WanTransformer3DModel, config, ours)
        model.rope = WanRotaryPosEmbed(ours.config.attention_head_dim, ours.config.patch_size,
                                       ours.config.rope_max_seq_len).to(ours.device)
        return model

    config = pipeline.scheduler_config
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=config.flow_shift,
        solver_order=config.solver_order, solver_type=config.solver_type,
        num_train_timesteps=config.num_train_timesteps)
    pipe = WanPipeline(tokenizer=pipeline.tokenizer, text_encoder=pipeline.text_encoder,
                       vae=pipeline.vae, scheduler=scheduler,
                       transformer=theirs(pipeline.transformer),
                       transformer_2=theirs(pipeline.transformer_2),
                       boundary_ratio=pipeline.boundary_ratio,
                       expand_timesteps=pipeline.vae.config.z_dim == 48)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def wan_step(gen, pipe, args, device) -> dict:
    pipeline = gen.pipeline
    height, width = args.wan_size
    grid = pipeline.latent_size(args.wan_frames, height, width)
    dtype = pipeline.transformer.dtype
    latents = torch.randn(1, pipeline.vae.config.z_dim, *grid,
                          generator=torch.Generator().manual_seed(0)).to(device, dtype)
    text = pipeline.encode_prompts([NEGATIVE, PROMPT]).to(dtype)
    t = torch.tensor([900, 900], device=device)
    ours_s, ours_all, ours_out = timed(
        lambda: pipeline.transformer(latents.expand(2, -1, -1, -1, -1), t, text),
        device, args.warmup, args.runs)

    def theirs_step():
        return torch.cat([pipe.transformer(hidden_states=latents, timestep=t[:1],
                                           encoder_hidden_states=row[None],
                                           return_dict=False)[0] for row in text])

    theirs_s, theirs_all, theirs_out = timed(theirs_step, device, args.warmup, args.runs)
    patch = pipeline.transformer.config.patch_size
    tokens = grid[0] // patch[0] * (grid[1] // patch[1]) * (grid[2] // patch[2])
    return {"size": f"{width}x{height}x{args.wan_frames}", "video_tokens": tokens,
            "ours_s": ours_s, "diffusers_s": theirs_s, "ours_runs": ours_all,
            "diffusers_runs": theirs_all, "speedup": theirs_s / ours_s,
            "rel_error": relative(ours_out, theirs_out)}


@torch.no_grad()
def wan_pipeline(gen, pipe, args, device) -> dict:
    height, width = args.wan_size
    size = dict(num_frames=args.wan_frames, height=height, width=width)
    seen = {}

    def keep(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    def run_ours(steps):
        return gen.generate(PROMPT, VisualGenParams(
            **size, num_inference_steps=steps, guidance_scale=WAN_GUIDANCE,
            negative_prompt=NEGATIVE, seed=0, return_latents=True)).latents

    def run_theirs(steps):
        pipe(PROMPT, negative_prompt=NEGATIVE, **size, num_inference_steps=steps,
             guidance_scale=WAN_GUIDANCE, generator=torch.Generator().manual_seed(0),
             output_type="np", callback_on_step_end=keep)
        return seen["latents"]

    return compare_pipelines(run_ours, run_theirs, args.wan_steps, device,
                             f"{width}x{height}x{args.wan_frames}")


def compare_pipelines(run_ours, run_theirs, steps: int, device, size: str) -> dict:
    run_ours(2), run_theirs(2)
    ours_s, _, ours_latents = timed(lambda: run_ours(steps), device, 0, 1)
    theirs_s, _, theirs_latents = timed(lambda: run_theirs(steps), device, 0, 1)
    return {"size": size, "steps": steps, "ours_s": ours_s, "diffusers_s": theirs_s,
            "speedup": theirs_s / ours_s,
            "latents_rel_error": relative(ours_latents, theirs_latents)}


# ---- main ----

FAMILIES = {"flux": ("flux_model", flux_reference, flux_step, flux_pipeline, "FLUX.1-dev"),
            "wan": ("wan_model", wan_reference, wan_step, wan_pipeline, "Wan 2.2 TI2V-5B")}


def run_family(name: str, args, device) -> dict:
    model_arg, reference, step, pipeline = FAMILIES[name][:4]
    start = time.perf_counter()
    gen = VisualGen(getattr(args, model_arg), dtype=args.dtype, device=args.device,
                    show_progress=False)
    result = {"model": getattr(args, model_arg), "build_s": time.perf_counter() - start}
    if args.parts & {"step", "pipeline"}:
        pipe = reference(gen.pipeline)
        if "step" in args.parts:
            result["step"] = step(gen, pipe, args, device)
            print(json.dumps({name: result["step"]}), file=sys.stderr)
        if "pipeline" in args.parts:
            result["pipeline"] = pipeline(gen, pipe, args, device)
            print(json.dumps({name: result["pipeline"]}), file=sys.stderr)
        del pipe   # it holds views of our weights: fp8 below must free them
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["opts"] = run_opts(gen, name, args, device)
    del gen
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def print_table(results: dict) -> None:
    if any("step" in f or "pipeline" in f for f in results["families"].values()):
        print(f"\n| {results['device']}, {results['dtype']} | size | ours s | diffusers s | "
              f"speed-up | rel. error |\n|---|---|---|---|---|---|")
    for name, family in results["families"].items():
        label = FAMILIES[name][4]
        if "step" in family:
            step = family["step"]
            what = "one step" if name == "flux" else "one CFG step"
            print(f"| {label}: transformer, {what} | {step['size']} | {step['ours_s']:.3f} | "
                  f"{step['diffusers_s']:.3f} | {step['speedup']:.2f}x | "
                  f"{step['rel_error']:.2e} |")
        if "pipeline" in family:
            pipe = family["pipeline"]
            print(f"| {label}: pipeline, {pipe['steps']} steps + decode | {pipe['size']} | "
                  f"{pipe['ours_s']:.2f} | {pipe['diffusers_s']:.2f} | {pipe['speedup']:.2f}x "
                  f"| {pipe['latents_rel_error']:.2e} |")
    print_opts_table(results, {name: family[4] for name, family in FAMILIES.items()})


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {sorted(FAMILIES)}")
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "families": {}}
    out = args.out or Path(os.environ.get("OUT") or "/tmp/gpu_flux_wan") / "gpu_flux_wan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:  # saved after each family: a time limit keeps the first's figures
        results["families"][name] = run_family(name, args, device)
        out.write_text(json.dumps(results, indent=2))
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
