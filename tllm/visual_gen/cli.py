"""`tllm visual`: generate images from prompts and write them as PNG files."""
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
        "visual", help="generate images from prompts (diffusion models)",
        description="Generate images with a diffusion model and write them as PNG files: "
                    "OUT for one image, OUT's name with _0, _1, ... for several; the "
                    "layered model writes one file per layer the same way.")
    parser.add_argument("--model", "-m", required=True,
                        help="diffusers model folder (model_index.json), 'dummy:qwen-image' or "
                             "'dummy:qwen-image-layered'")
    parser.add_argument("--prompt", "-p", action="append", required=True,
                        help="a prompt (for the layered model, a caption of the input image); "
                             "repeat the option for a batch")
    parser.add_argument("--out", "-o", default="image.png", help="output PNG (default image.png)")
    parser.add_argument("--image", action="append",
                        help="input image of the layered model (one, or one per prompt)")
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
                       help="for guidance-distilled models only")
    group.add_argument("--n", type=positive_int, default=1, help="images per prompt")
    group.add_argument("--layers", type=positive_int, help="layered model: layers (default 4)")
    group.add_argument("--resolution", type=int, choices=LAYERED_RESOLUTIONS,
                       help="layered model: size bucket (default 640)")
    group = parser.add_argument_group("model")
    group.add_argument("--dtype", default="auto",
                       choices=["auto", "float32", "float16", "bfloat16"])
    group.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    group.add_argument("--transformer-impl", default="auto", choices=["auto", "tllm", "diffusers"],
                       help="tllm's transformer or diffusers' (default: tllm's)")
    parser.set_defaults(run=run_visual)
    return parser


def run_visual(args: argparse.Namespace) -> int:
    require_extra("visual", "tllm visual")  # before the input images are opened
    from tllm.visual_gen.api import VisualGen

    params = VisualGenParams(
        height=args.height, width=args.width, num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale, true_cfg_scale=args.true_cfg_scale,
        negative_prompt=args.negative_prompt, seed=args.seed, num_images_per_prompt=args.n,
        layers=args.layers, resolution=args.resolution)
    images = [_open_image(path) for path in args.image] if args.image else None
    start = time.perf_counter()
    gen = VisualGen(args.model, dtype=args.dtype, device=args.device,
                    transformer_impl=args.transformer_impl)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    output = gen.generate(args.prompt, params, image=images)
    elapsed = time.perf_counter() - start
    for path, image in zip(output_paths(Path(args.out), output.images), _flat(output.images)):
        image.save(path)
        print(path)
    print(f"{len(output.images)} image{'s' if len(output.images) != 1 else ''} in "
          f"{elapsed:.2f} s (seeds {output.seeds[0]}..{output.seeds[-1]})", file=sys.stderr)
    return 0


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
