"""One denoising step of Qwen-Image's transformer with true CFG: ours (one forward over the
batch [uncond, cond], text right-padded and masked) against diffusers' QwenImageTransformer2DModel
(two forwards, cond then uncond, as its QwenImagePipeline runs them), on the same dummy weights:
diffusers' model is built on the meta device and given views of our (fused) parameters, so the
weights exist once.

Reports ms per step (CUDA events, median), peak memory, achieved TFLOP/s (matmul and attention
FLOPs counted analytically, on the valid tokens only) against a large matmul measured in the same
run, and how far the two outputs are apart. Low-precision outputs of two implementations drift
apart over 60 random layers, so correctness is judged on a shallow copy (--check-layers): ours
and diffusers' in the benchmark dtype, each against diffusers in float32 on the same weights;
ours must be no further off than diffusers', and ours in float32 must match it to 1e-4.

    python benchmarks/visual_gen_transformer.py --out results.json            # H200: 60 layers
    python benchmarks/visual_gen_transformer.py --layers 8 --steps-timed 5    # quick
    python benchmarks/visual_gen_transformer.py --device cpu --dtype float32 --layers 2 \\
        --height 256 --width 256 --warmup 1 --steps-timed 1                   # smoke test

Prints a markdown table last; writes every number as JSON to --out. Exits 1 if a check fails."""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tllm.visual_gen.models.qwen_image.transformer import (  # noqa: E402
    QwenImageTransformer, QwenImageTransformerConfig, dummy_transformer_config,
    init_dummy_weights)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
FP32_TOL = 1e-4
LATENT_DOWNSCALE = 16  # the VAE's 8x, then 2x2 patch packing


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen-image", choices=["qwen-image", "qwen-image-layered"])
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--cond-len", type=int, default=200, help="text tokens of the prompt")
    p.add_argument("--uncond-len", type=int, default=30, help="text tokens of the negative")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps-timed", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--skip-diffusers", action="store_true")
    p.add_argument("--check-layers", type=int, default=4,
                   help="layers of the copy the numerics are checked on (0: no check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.height % LATENT_DOWNSCALE or args.width % LATENT_DOWNSCALE:
        p.error(f"--height and --width must be multiples of {LATENT_DOWNSCALE}")
    if min(args.layers, args.cond_len, args.uncond_len, args.steps_timed) <= 0:
        p.error("--layers, --cond-len, --uncond-len and --steps-timed must be positive")
    return args


def build_ours(config: QwenImageTransformerConfig, dtype, device, seed: int | None):
    """Dummy weights from `seed`; with seed None, left empty for loading."""
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    model = model.to(dtype=dtype).to_empty(device=device).eval()
    if seed is not None:
        init_dummy_weights(model, seed)
    return model


def build_diffusers(ours: QwenImageTransformer):
    """diffusers' model on our weights (views; nothing copied)."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers import transformer_qwenimage as qi
    kwargs = dataclasses.asdict(ours.config)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**kwargs)
    # its RoPE tables are plain tensors built in __init__: rebuild them off the meta device
    rope_cls = qi.QwenEmbedLayer3DRope if ours.config.use_layer3d_rope else qi.QwenEmbedRope
    model.pos_embed = rope_cls(theta=10000, axes_dim=list(ours.config.axes_dims_rope),
                               scale_rope=True)
    model.load_state_dict(ours.diffusers_state_dict(), strict=True, assign=True)
    return model.eval()


def make_inputs(args, config: QwenImageTransformerConfig, dtype, device):
    """(ours: batched [uncond, cond] kwargs, diffusers: [cond kwargs, uncond kwargs])."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    rows, cols = args.height // LATENT_DOWNSCALE, args.width // LATENT_DOWNSCALE
    shapes = [(1, rows, cols)]
    extra = {}
    if config.use_layer3d_rope:  # one generated layer plus the condition image
        shapes = [(1, rows, cols)] * 2 + [(1, rows, cols)]
        extra = {"additional_t_cond": torch.zeros(1, dtype=torch.long, device=device)}
    num_img = sum(f * h * w for f, h, w in shapes)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    latents = randn(1, num_img, config.in_channels)
    cond, uncond = randn(1, args.cond_len, config.joint_attention_dim), randn(
        1, args.uncond_len, config.joint_attention_dim)
    t = torch.full((1,), 0.7, device=device, dtype=dtype)
    single = [dict(hidden_states=latents, encoder_hidden_states=text,
                   encoder_hidden_states_mask=None, timestep=t, img_shapes=[shapes], **extra)
              for text in (cond, uncond)]
    max_len = max(args.cond_len, args.uncond_len)
    padded = torch.zeros(2, max_len, config.joint_attention_dim, device=device, dtype=dtype)
    mask = torch.zeros(2, max_len, dtype=torch.long, device=device)
    for row, text in enumerate((uncond, cond)):
        padded[row, :text.shape[1]] = text[0]
        mask[row, :text.shape[1]] = 1
    batched = dict(hidden_states=latents.expand(2, -1, -1), encoder_hidden_states=padded,
                   encoder_hidden_states_mask=mask, timestep=t.expand(2),
                   img_shapes=[shapes] * 2, **{k: v.expand(2) for k, v in extra.items()})
    return batched, single, num_img


def step_flops(config: QwenImageTransformerConfig, num_img: int, txt_lens) -> float:
    """Matmul + attention FLOPs of one CFG step (both rows), valid tokens only."""
    d, layers = config.inner_dim, config.num_layers
    total = 0.0
    for txt in txt_lens:
        tokens, seq = num_img + txt, num_img + txt
        per_layer = 2 * tokens * 12 * d * d + 4 * seq * seq * d + 2 * 12 * d * d
        embed = 2 * (num_img * config.in_channels * d + txt * config.joint_attention_dim * d
                     + num_img * d * config.out_dim + 256 * d + d * d + 2 * d * d)
        total += layers * per_layer + embed
    return total


def time_ms(fn, warmup: int, iters: int, device) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def peak_memory_gb(fn, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) / 1e9


def matmul_tflops(device, dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    ms = statistics.median(time_ms(lambda: a @ b, 3, 10, device))
    return 2 * n ** 3 / ms / 1e9


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def check_numerics(args, config, dtype, device) -> dict:
    """Errors against diffusers in float32 on a --check-layers copy: ours and diffusers' in
    `dtype`, and ours in float32."""
    config = dataclasses.replace(config, num_layers=args.check_layers)
    ours = build_ours(config, dtype, device, args.seed)
    ours32 = build_ours(config, torch.float32, device, None)
    ours32.load_diffusers_state_dict(ours.diffusers_state_dict())
    theirs, theirs32 = build_diffusers(ours), build_diffusers(ours32)
    batched, single, _ = make_inputs(args, config, dtype, device)
    batched32, single32 = _upcast(batched), [_upcast(kw) for kw in single]

    def diffusers_rows(model, inputs):  # as [uncond, cond]
        cond, uncond = (model(**kw, return_dict=False)[0] for kw in inputs)
        return torch.cat([uncond, cond])
    ref = diffusers_rows(theirs32, single32)
    errors = dict(ours=relative_error(ours(**batched), ref),
                  diffusers=relative_error(diffusers_rows(theirs, single), ref),
                  ours_float32=relative_error(ours32(**batched32), ref))
    errors["ok"] = (errors["ours"] <= 1.5 * errors["diffusers"] + 1e-3
                    and errors["ours_float32"] < FP32_TOL)
    return errors


def _upcast(kwargs: dict) -> dict:
    """The same inputs in float32 (a timestep rounded to bf16 stays rounded: it changes the
    timestep embedding far more than any rounding inside the model)."""
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in kwargs.items()}


def main() -> int:
    args = parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    config = dataclasses.replace(dummy_transformer_config(args.model), num_layers=args.layers)
    results = dict(args={k: str(v) for k, v in vars(args).items()}, device=_device_name(device),
                   torch=torch.__version__, runs={})
    with torch.inference_mode():
        if args.check_layers and not args.skip_diffusers:
            results["check"] = check_numerics(args, config, dtype, device)
        ours = build_ours(config, dtype, device, args.seed)
        batched, single, num_img = make_inputs(args, config, dtype, device)
        flops = step_flops(config, num_img, (args.cond_len, args.uncond_len))
        results.update(params=sum(p.numel() for p in ours.parameters()), image_tokens=num_img,
                       step_tflop=flops / 1e12, matmul_tflops=matmul_tflops(device, dtype))
        runs = {"ours: 1 forward, batch [uncond, cond]": lambda: ours(**batched),
                "ours: 2 forwards (no batching)": lambda: [ours(**kw) for kw in single]}
        outputs = {"ours": ours(**batched)}
        if not args.skip_diffusers:
            theirs = build_diffusers(ours)

            def diffusers_step():
                return [theirs(**kw, return_dict=False)[0] for kw in single]
            runs["diffusers: 2 forwards (cond, uncond)"] = diffusers_step
            cond, uncond = diffusers_step()
            outputs["diffusers"] = torch.cat([uncond, cond])
        for name, fn in runs.items():
            times = time_ms(fn, args.warmup, args.steps_timed, device)
            ms = statistics.median(times)
            results["runs"][name] = dict(ms_per_step=ms, times_ms=times,
                                         tflops=flops / ms / 1e9,
                                         peak_memory_gb=peak_memory_gb(fn, device))
    ok = _compare_outputs(outputs, results)
    _print_table(results, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


def _compare_outputs(outputs, results) -> bool:
    """Finite, and (informative only) how far the full-depth outputs are apart."""
    ok = bool(torch.isfinite(outputs["ours"]).all())
    if "diffusers" in outputs:
        results["rel_error_vs_diffusers"] = relative_error(outputs["ours"], outputs["diffusers"])
    ok = ok and results.get("check", {}).get("ok", True)
    results["outputs_ok"] = ok
    return ok


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _print_table(results, args) -> None:
    print(f"\nQwen-Image transformer, {args.layers} layers, {args.height}x{args.width} "
          f"({results['image_tokens']} image tokens), text {args.cond_len} + {args.uncond_len}, "
          f"{args.dtype} on {results['device']}, {results['params'] / 1e9:.2f}B params; "
          f"{results['step_tflop']:.1f} TFLOP per step; matmul "
          f"{results['matmul_tflops']:.3g} TFLOP/s")
    if "check" in results:
        c = results["check"]
        print(f"numerics on {args.check_layers} layers, error vs diffusers in float32: ours "
              f"{c['ours']:.2e}, diffusers {c['diffusers']:.2e}, ours in float32 "
              f"{c['ours_float32']:.2e} ({'ok' if c['ok'] else 'FAIL'})")
    if "rel_error_vs_diffusers" in results:
        print(f"full depth, ours vs diffusers: {results['rel_error_vs_diffusers']:.2e} "
              f"(drift of two {args.dtype} implementations; informative)")
    base = results["runs"].get("diffusers: 2 forwards (cond, uncond)")
    print("\n| run | ms / step | vs diffusers | TFLOP/s | % of matmul | peak GB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, run in results["runs"].items():
        speedup = f"{base['ms_per_step'] / run['ms_per_step']:.2f}x" if base else "-"
        memory = f"{run['peak_memory_gb']:.1f}" if run["peak_memory_gb"] is not None else "-"
        print(f"| {name} | {run['ms_per_step']:.1f} | {speedup} | {run['tflops']:.3g} | "
              f"{100 * run['tflops'] / results['matmul_tflops']:.0f}% | {memory} |")


if __name__ == "__main__":
    sys.exit(main())
