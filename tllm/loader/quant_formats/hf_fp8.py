"""Hugging Face `quant_method: "fp8"`: transformers' FineGrainedFP8 layout, as DeepSeek-V3 and
Qwen3-FP8 ship it (e4m3 `weight` with a float32 `weight_scale_inv` per `weight_block_size`
block, activations quantized per token and group of block columns at run time). Without a
block size the scales are per tensor: `weight_scale` / `input_scale` in vLLM's and AutoFP8's
checkpoints, `weight_scale_inv` / `activation_scale` in transformers' own."""
from __future__ import annotations

from tllm.layers.quant.fp8 import Fp8Config, Fp8Scheme
from tllm.loader.quant_formats import unsupported

FORMAT = "fp8 (Hugging Face)"
PER_TENSOR_ALIASES = (("weight_scale_inv", "weight_scale"), ("activation_scale", "input_scale"))


def parse(raw: dict) -> Fp8Config:
    values = str(raw.get("fmt", "e4m3")).lower()
    if values != "e4m3":
        raise unsupported(FORMAT, f"{values} values")
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise unsupported(FORMAT, f"{scale_fmt} block scales")
    if raw.get("expert_dtype", "fp8") != "fp8":
        raise unsupported(FORMAT, f"{raw['expert_dtype']} experts")
    if raw.get("modules_to_convert"):
        raise unsupported(FORMAT, f"quantized non-linear modules {raw['modules_to_convert']}")
    activation = str(raw.get("activation_scheme", "dynamic")).lower()
    if activation not in ("dynamic", "static"):
        raise unsupported(FORMAT, f"activation_scheme {activation!r}")
    ignore = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
    block = raw.get("weight_block_size")
    if block is None:
        return Fp8Config(Fp8Scheme(weight="tensor", activation=activation),
                         ignore_patterns(ignore), param_aliases=PER_TENSOR_ALIASES)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and n > 0 for n in block)):
        raise unsupported(FORMAT, f"weight_block_size {block!r}")
    if activation == "static":
        raise unsupported(FORMAT, "block-wise weights and static activations")
    return Fp8Config(Fp8Scheme(weight="block", block=(block[0], block[1])),
                     ignore_patterns(ignore))


def ignore_patterns(keys) -> tuple[str, ...]:
    """transformers skips a module when a key matches its name as a regex from the start up to
    a module boundary ("model.layers.1" skips layer 1, not 11), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return tuple(p for key in keys for p in (f"re:(?:{key}){boundary}.*", key))
