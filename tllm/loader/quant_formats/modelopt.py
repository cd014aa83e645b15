"""NVIDIA ModelOpt FP8: `hf_quant_config.json` beside config.json ({"producer": {"name":
"modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" | null,
"exclude_modules": [...]}}), or newer exports' config.json `quantization_config` with
`quant_method: "modelopt"` ("quant_algo", "kv_cache_scheme", "ignore"). "FP8": per-tensor
`weight_scale` and static `input_scale` scalars per linear layer; "FP8_PER_CHANNEL_PER_TOKEN":
a `weight_scale` per output channel [N], activations per token at run time; kv cache scales
as `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`."""
from __future__ import annotations

from tllm.layers.quant.fp8 import Fp8Config, Fp8Scheme
from tllm.loader.quant_formats import unsupported

FORMAT = "ModelOpt"
SCHEMES = {"FP8": Fp8Scheme(weight="tensor", activation="static"),
           "FP8_PER_CHANNEL_PER_TOKEN": Fp8Scheme(weight="channel", activation="dynamic")}


def parse(raw: dict) -> Fp8Config:
    quant = raw.get("quantization")
    if isinstance(quant, dict):  # hf_quant_config.json
        algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
        exclude = quant.get("exclude_modules") or ()
    else:  # config.json, compressed-tensors style keys
        algo, kv_algo = raw.get("quant_algo"), raw.get("kv_cache_quant_algo")
        kv = raw.get("kv_cache_scheme")
        if isinstance(kv, dict):
            is_fp8 = kv.get("type") == "float" and kv.get("num_bits") == 8
            kv_algo = "FP8" if is_fp8 else f"{kv.get('type')}{kv.get('num_bits')}"
        exclude = raw.get("ignore") or raw.get("exclude_modules") or ()
    algo = str(algo).upper() if algo else None
    if algo not in SCHEMES:
        raise unsupported(FORMAT, f"quant_algo {algo!r}")
    kv_algo = str(kv_algo).upper() if kv_algo else None
    if kv_algo not in (None, "FP8"):
        raise unsupported(FORMAT, f"kv_cache_quant_algo {kv_algo!r}")
    # exclude_modules are fnmatch wildcards over module names ("lm_head", "*mlp.gate")
    return Fp8Config(SCHEMES[algo], tuple(exclude), has_kv_scales=kv_algo == "FP8")
