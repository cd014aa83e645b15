"""LTX-2 on the GPU (the LTX-2 section of benchmarks/gpu_video.py): per-step transformer time
and whole-pipeline seconds, ours against diffusers on the same weights in the same process.

Ours is `VisualGen("dummy:ltx2")` (random weights in LTX-2.0's shapes: the 48-layer 19B
audio-video transformer, Gemma-3-12B's text model, the connectors, both VAEs, the vocoder).
diffusers' side is its LTX2VideoTransformer3DModel sharing our weights
(`DiffusersLTX2.from_ours`, views, no copy) and, for the pipeline, its LTX2Pipeline assembled
from that transformer and our very text encoder, connectors, VAEs and vocoder, with a
FlowMatchEulerDiscreteScheduler of our scheduler's config.

1. check: one guided step's velocities, ours vs diffusers (bf16 relative error).
2. step: one denoising step of the transformer at diffusers' default guidance, at --height x
   --width x --frames (default 512 x 768 x 121, diffusers' default: 16 x 16 x 24 latents,
   6,144 video + 126 audio tokens a branch). Ours: the three branches it needs (uncond, cond,
   modality-isolated) in one forward. diffusers: the same three branches as its pipeline
   calls them (a batch of two, then one), and as its pipeline runs a step (plus the STG
   forward, which equals cond on LTX-2.0). --warmup then --runs timed steps, median.
3. pipeline: text to video with sound end to end (text encoder, connectors, noise,
   --pipe-steps steps with diffusers' default guidance, video VAE decode, audio VAE +
   vocoder) at the same size (default 8 steps; diffusers' default is 30); one warm-up run of
   2 steps each, then one timed run each; final video latents compared.

    python benchmarks/gpu_video.py --family ltx2 --out gpu_video_ltx2.json   # H200, < 3 min
    python benchmarks/gpu_video.py --family ltx2 --tiny --device cpu --dtype float32
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tllm.visual_gen import VisualGen, VisualGenParams
from tllm.visual_gen.models.ltx2.diffusers_transformer import DiffusersLTX2
from tllm.visual_gen.models.ltx2.guidance import LTX2Guidance
from tllm.visual_gen.models.ltx2.pipeline import VideoRequest
from tllm.visual_gen.models.ltx2.rope import LTX2Rope
from tllm.visual_gen.models.ltx2.transformer import LTX2Inputs

PROMPT = ("A woman with long brown hair smiles at another woman, warm light of the setting sun, "
          "waves crash on the rocks behind them")
NEGATIVE = "worst quality, inconsistent motion, blurry, jittery, distorted"
DEFAULT_SIZE = dict(height=512, width=768, frames=121, pipe_steps=8)
TINY_SIZE = dict(height=32, width=32, frames=9, pipe_steps=3)


def setup(args) -> None:
    """LTX-2's sizes (the Cosmos defaults of gpu_video.py do not apply)."""
    if args.tiny:
        from tests.visual_gen.tiny_ltx2 import save_tiny_ltx2
        args.model = str(save_tiny_ltx2(Path(tempfile.mkdtemp(prefix="tiny_ltx2_"))))
    elif args.model == "dummy:cosmos":
        args.model = "dummy:ltx2"
    size = TINY_SIZE if args.tiny else DEFAULT_SIZE
    for name, value in size.items():
        if getattr(args, f"ltx_{name}") is None:
            setattr(args, f"ltx_{name}", value)


def step_inputs(pipeline, args):
    """One step's inputs at diffusers' default guidance: random latents, the prompt context
    of the three branches, the rotary tables; the guidance rule."""
    request = VideoRequest.resolve(VisualGenParams(
        num_frames=args.ltx_frames, height=args.ltx_height, width=args.ltx_width,
        negative_prompt=NEGATIVE))
    grid = pipeline.latent_grid(request)
    streams = pipeline.initial_latents(grid, torch.Generator().manual_seed(0))
    scheduler = pipeline.scheduler(30, grid)
    guidance = LTX2Guidance(request.scales(), scheduler.sigmas)
    rope = LTX2Rope.build(pipeline.config, *pipeline.positions(grid, request.frame_rate))
    num = guidance.num_branches
    rows = torch.ones(num, device=pipeline.device)
    rows[-1] = 0
    timestep = scheduler.timesteps[0].expand(num)
    video, audio = (streams[k].expand(num, -1, -1) for k in ("video", "audio"))
    return request, video, audio, timestep, rope, rows, guidance


def prompt_states(pipeline, request, guidance):
    prompts = [request.negative_prompt, PROMPT]
    states, mask = pipeline.text_states(prompts)
    video, audio, mask = pipeline.connectors(states, mask, padding_side="left")
    rows = torch.tensor([0, 1, 1], device=video.device)
    return video[rows], audio[rows], mask[rows]


@torch.no_grad()
def bench_step(pipeline, theirs, args, device, timed, relative) -> dict:
    ours = pipeline.transformer
    request, video, audio, timestep, rope, rows, guidance = step_inputs(pipeline, args)
    text_video, text_audio, mask = prompt_states(pipeline, request, guidance)
    ours_text = ours.encode_text(text_video, text_audio, mask)
    theirs_text = theirs.encode_text(text_video, text_audio, mask)
    ours_in = LTX2Inputs(video, audio, timestep, ours_text, rope, cross_rows=rows)
    theirs_in = LTX2Inputs(video, audio, timestep, theirs_text, rope, cross_rows=rows)
    stg_in = LTX2Inputs(video[1:2], audio[1:2], timestep[1:2], _row(theirs_text, 1), rope)

    def theirs_as_pipeline():
        out = theirs(theirs_in)
        theirs(stg_in)          # diffusers' STG forward (the cond branch again on LTX-2.0)
        return out

    ours_s, ours_all, ours_out = timed(lambda: ours(ours_in), device, args.warmup, args.runs)
    same_s, same_all, theirs_out = timed(lambda: theirs(theirs_in), device, args.warmup,
                                         args.runs)
    pipe_s, pipe_all, _ = timed(theirs_as_pipeline, device, args.warmup, args.runs)
    text_s, _, _ = timed(lambda: ours.encode_text(text_video, text_audio, mask), device, 1, 1)
    return {"size": f"{args.ltx_width}x{args.ltx_height}x{args.ltx_frames}",
            "video_tokens": video.shape[1], "audio_tokens": audio.shape[1],
            "text_tokens": text_video.shape[1], "branches": video.shape[0],
            "ours_s": ours_s, "diffusers_same_branches_s": same_s,
            "diffusers_pipeline_step_s": pipe_s, "ours_runs": ours_all,
            "diffusers_same_runs": same_all, "diffusers_pipeline_runs": pipe_all,
            "ours_prompt_kv_once_s": text_s,
            "speedup_same_branches": same_s / ours_s, "speedup_pipeline_step": pipe_s / ours_s,
            "rel_error_video": relative(ours_out[0], theirs_out[0]),
            "rel_error_audio": relative(ours_out[1], theirs_out[1])}


def _row(text, index: int):
    from tllm.visual_gen.models.ltx2.diffusers_transformer import DiffusersText
    mask = None if text.mask is None else text.mask[index:index + 1]
    return DiffusersText(text.video[index:index + 1], text.audio[index:index + 1], mask)


def diffusers_pipeline(pipeline, theirs):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    config = pipeline.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=config.use_dynamic_shifting, base_shift=config.base_shift,
        max_shift=config.max_shift, base_image_seq_len=config.base_image_seq_len,
        max_image_seq_len=config.max_image_seq_len, shift_terminal=config.shift_terminal,
        time_shift_type=config.time_shift_type)
    pipe = LTX2Pipeline(scheduler=scheduler, vae=pipeline.vae, audio_vae=pipeline.audio_vae,
                        text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer,
                        connectors=pipeline.connectors, transformer=theirs.model,
                        vocoder=pipeline.vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def bench_pipeline(gen, theirs, args, device, timed, relative) -> dict:
    pipe = diffusers_pipeline(gen.pipeline, theirs)
    seen = {}

    def keep(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    def run_ours(steps):
        params = VisualGenParams(num_frames=args.ltx_frames, height=args.ltx_height,
                                 width=args.ltx_width, num_inference_steps=steps,
                                 negative_prompt=NEGATIVE, seed=0, return_latents=True)
        return gen.generate(PROMPT, params).latents

    def run_theirs(steps):
        pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=args.ltx_frames,
             height=args.ltx_height, width=args.ltx_width, num_inference_steps=steps,
             generator=torch.Generator().manual_seed(0), output_type="np",
             max_sequence_length=gen.pipeline.max_text_tokens, callback_on_step_end=keep)
        return seen["latents"]

    run_ours(2), run_theirs(2)
    ours_s, _, ours_latents = timed(lambda: run_ours(args.ltx_pipe_steps), device, 0, 1)
    theirs_s, _, theirs_latents = timed(lambda: run_theirs(args.ltx_pipe_steps), device, 0, 1)
    return {"size": f"{args.ltx_width}x{args.ltx_height}x{args.ltx_frames}",
            "steps": args.ltx_pipe_steps, "ours_s": ours_s, "diffusers_s": theirs_s,
            "speedup": theirs_s / ours_s,
            "latents_rel_error": relative(ours_latents, theirs_latents)}


def run(args, device, timed, relative) -> dict:
    setup(args)
    start = time.perf_counter()
    gen = VisualGen(args.model, dtype=args.dtype, device=args.device, show_progress=False)
    theirs = DiffusersLTX2.from_ours(gen.pipeline.transformer)
    build_s = time.perf_counter() - start
    print(f"built LTX-2 (ours + diffusers' view) in {build_s:.1f} s", file=sys.stderr)
    results = {"model": args.model, "build_s": build_s}
    results["step"] = bench_step(gen.pipeline, theirs, args, device, timed, relative)
    print(json.dumps(results["step"]), file=sys.stderr)
    if not args.skip_pipeline:
        results["pipeline"] = bench_pipeline(gen, theirs, args, device, timed, relative)
        print(json.dumps(results["pipeline"]), file=sys.stderr)
    return results


def print_table(results: dict, device_name: str, dtype: str) -> None:
    step = results["step"]
    print(f"\n| LTX-2 ({device_name}, {dtype}) | size | ours s | diffusers s | speed-up | "
          f"rel. error |\n|---|---|---|---|---|---|")
    tokens = f"{step['video_tokens']} video + {step['audio_tokens']} audio tokens"
    print(f"| transformer, one step, {step['branches']} branches ({tokens}) | {step['size']} | "
          f"{step['ours_s']:.3f} | {step['diffusers_same_branches_s']:.3f} | "
          f"{step['speedup_same_branches']:.2f}x | {step['rel_error_video']:.2e} |")
    print(f"| transformer, one step as each pipeline runs it (diffusers + STG forward) | "
          f"{step['size']} | {step['ours_s']:.3f} | {step['diffusers_pipeline_step_s']:.3f} | "
          f"{step['speedup_pipeline_step']:.2f}x | {step['rel_error_audio']:.2e} (audio) |")
    if "pipeline" in results:
        pipe = results["pipeline"]
        print(f"| whole pipeline, {pipe['steps']} steps + video/audio decode | {pipe['size']} | "
              f"{pipe['ours_s']:.2f} | {pipe['diffusers_s']:.2f} | {pipe['speedup']:.2f}x | "
              f"{pipe['latents_rel_error']:.2e} |")
