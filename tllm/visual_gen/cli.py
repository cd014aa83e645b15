"""`tllm visual`: generate images (PNG files) or videos (MP4 files) from prompts."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tllm.cli_types import positive_int
from tllm.extras import require_extra
from tllm.visual_gen.params import LAYERED_RESOLUTIONS, VisualGenParams


def add_visual_parser(commands) -> argparse.ArgumentParser:
    """Add the `visual` subcommand to an argparse subparsers object."""
    parser = commands.add_parser(
        "visual", help="generate images or videos from prompts (diffusion models)",
        description="Generate images with a diffusion model and write them as PNG files "
                    "(videos as MP4 files, for a video model): OUT for one, OUT's name with "
                    "_0, _1, ... for several; the layered model writes one file per layer "
                    "the same way.")
    parser.add_argument("--model", "-m", required=True,
                        help="diffusers model folder (model_index.json), 'dummy:qwen-image', "
                             "'dummy:qwen-image-layered', 'dummy:flux.1-dev', "
                             "'dummy:flux.1-schnell', 'dummy:cosmos', 'dummy:ltx2', "
                             "'dummy:wan2.2-ti2v-5b' or 'dummy:wan2.2-t2v-a14b' "
                             "(random weights in the real shapes: a GPU's worth), or "
                             "'dummy:qwen-image-tiny' (tiny shapes: seconds on a CPU)")
    parser.add_argument("--prompt", "-p", action="append", required=True,
                        help="a prompt (for the layered model, a caption of the input image); "
                             "repeat the option for a batch")
    parser.add_argument("--out", "-o", help="output PNG, or MP4 for a video model (default "
                        "image.png or clip.mp4)")
    parser.add_argument("--image", action="append",
                        help="input image of the layered model, or of image-to-video (one, or "
                             "one per prompt)")
    group = parser.add_argument_group("generation")
    group.add_argument("--steps", type=positive_int, default=50,
                       help="denoising steps (default 50)")
    group.add_argument("--height", type=positive_int, help="default: the model's (1024)")
    group.add_argument("--width", type=positive_int, help="default: the model's (1024)")
    group.add_argument("--seed", type=int, help="image i uses seed + i (default: random)")
    group.add_argument("--negative-prompt", help="enables classifier-free guidance (with "
                       "--true-cfg-scale > 1); ' ' is the usual choice")
    group.add_argument("--true-cfg-scale", type=float, default=4.0,
                       help="classifier-free guidance scale (default 4.0)")
    group.add_argument("--guidance-scale", type=float,
                       help="guidance-distilled image models; a video model's guidance scale "
                            "(default its own, 1 disables)")
    group.add_argument("--num-frames", type=positive_int,
                       help="video models: frames (default the model's)")
    group.add_argument("--frame-rate", type=float, help="video models: frames per second")
    group.add_argument("--n", type=positive_int, default=1, help="images per prompt")
    group.add_argument("--layers", type=positive_int, help="layered model: layers (default 4)")
    group.add_argument("--resolution", type=int, choices=LAYERED_RESOLUTIONS,
                       help="layered model: size bucket (default 640)")
    group.add_argument("--cache", choices=["teacache", "first_block"],
                       help="step caching: skip transformer steps whose input barely changed")
    group.add_argument("--cache-threshold", type=float,
                       help="step caching's threshold (default 0.2 teacache, 0.1 first_block)")
    group = parser.add_argument_group("model")
    group.add_argument("--dtype", default="auto",
                       choices=["auto", "float32", "float16", "bfloat16"])
    group.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    group.add_argument("--transformer-impl", default="auto", choices=["auto", "tllm", "diffusers"],
                       help="tllm's transformer or diffusers' (default: tllm's)")
    group.add_argument("--quantization", choices=["fp8"],
                       help="fp8: the transformer blocks' linear layers in FP8")
    parser.set_defaults(run=run_visual)
    return parser


def run_visual(args: argparse.Namespace) -> int:
    require_extra("visual", "tllm visual")  # before the input images are opened
    from tllm.visual_gen.api import VisualGen

    params = VisualGenParams(
        height=args.height, width=args.width, num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale, true_cfg_scale=args.true_cfg_scale,
        negative_prompt=args.negative_prompt, seed=args.seed, num_images_per_prompt=args.n,
        layers=args.layers, resolution=args.resolution, num_frames=args.num_frames,
        frame_rate=args.frame_rate, cache=args.cache, cache_threshold=args.cache_threshold)
    images = [_open_image(path) for path in args.image] if args.image else None
    start = time.perf_counter()
    gen = VisualGen(args.model, dtype=args.dtype, device=args.device,
                    transformer_impl=args.transformer_impl, quantization=args.quantization)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    output = gen.generate(args.prompt, params, image=images)
    elapsed = time.perf_counter() - start
    if output.videos is not None:
        return _write_videos(output, Path(args.out or "clip.mp4"), elapsed)
    for path, image in zip(output_paths(Path(args.out or "image.png"), output.images),
                           _flat(output.images)):
        image.save(path)
        print(path)
    print(f"{len(output.images)} image{'s' if len(output.images) != 1 else ''} in "
          f"{elapsed:.2f} s (seeds {output.seeds[0]}..{output.seeds[-1]}){_skipped(output)}",
          file=sys.stderr)
    return 0


def _write_videos(output, out: Path, elapsed: float) -> int:
    from tllm.visual_gen.video_io import encode_mp4

    out = out if out.suffix else out.with_suffix(".mp4")
    for i, path in enumerate(output_paths(out, output.videos)):
        audio = output.audio[i] if output.audio else None
        path.write_bytes(encode_mp4(output.videos[i], output.frame_rate, audio,
                                    output.sample_rate))
        print(path)
    count = len(output.videos)
    print(f"{count} video{'s' if count != 1 else ''} in {elapsed:.2f} s (seeds "
          f"{output.seeds[0]}..{output.seeds[-1]}){_skipped(output)}", file=sys.stderr)
    return 0


def _skipped(output) -> str:
    if output.steps_skipped is None:
        return ""
    return f", steps skipped by the cache: {output.steps_skipped}"


def output_paths(out: Path, images: list) -> list[Path]:
    """OUT for a single image; OUT_<i> for several; OUT_<layer> (OUT_<i>_<layer> for several
    images) for lists of layers."""
    is_layered = bool(images) and isinstance(images[0], list)
    labels = [str(i) for i in range(len(images))] if len(images) > 1 else [""]
    if is_layered:
        labels = [f"{label}_{j}".lstrip("_") for label, layers in zip(labels, images)
                  for j in range(len(layers))]
    return [out if not label else out.with_name(f"{out.stem}_{label}{out.suffix or '.png'}")
            for label in labels]


def _flat(images: list) -> list:
    return [layer for item in images for layer in (item if isinstance(item, list) else [item])]


def _open_image(path: str):
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(path)
        image.load()
    except UnidentifiedImageError as exc:
        raise ValueError(f"--image {path}: not an image file") from exc
    return image
