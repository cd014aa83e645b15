"""Which quantization a model runs with: what the user asked for (`LlmArgs.quantization`),
or what the checkpoint's own config says it holds (detected, never guessed from tensors)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tllm.layers.quant import QuantConfig
from tllm.layers.quant.fp8 import Fp8Config, Fp8Scheme
from tllm.layers.quant.gguf import GgufConfig
from tllm.loader.hf import CheckpointError
from tllm.loader.quant_formats import SUPPORTED, awq, compressed, gptq, hf_fp8, modelopt, mxfp4

logger = logging.getLogger(__name__)


def resolve_quant_config(kind: str, path: Path | None, hf_config,
                         requested: str | None) -> QuantConfig | None:
    """The model's QuantConfig: the checkpoint's format when it declares one, else the
    requested on-the-fly quantization, else None (the checkpoint's dtype). "none" runs a
    GGUF file dequantized (as it ran before its blocks were kept) and anything unquantized."""
    if kind == "gguf":
        return gguf_quant_config(hf_config, requested)
    # a dummy preset may declare its model's format (GPT-OSS's MXFP4 experts)
    found = checkpoint_quant_config(path, hf_config) if kind in ("hf", "dummy") else None
    if found is not None:
        if requested is not None and requested != found.name:
            raise ValueError(f"quantization={requested!r} asked for, but the checkpoint is "
                             f"already quantized as {found.name!r}")
        return found
    if requested == "fp8":
        return Fp8Config(Fp8Scheme(checkpoint_is_fp8=False))
    if requested in ("int4_awq", "int8_wo", "int4_awq_int8_head"):
        from tllm.layers.quant.woq import online_config
        return online_config(requested)
    if requested == "gguf_int4":
        raise ValueError("quantization='gguf_int4' applies to GGUF files only")
    if requested not in (None, "none"):
        raise ValueError(f"quantization: unknown scheme {requested!r}")
    return None


def gguf_quant_config(hf_config, requested: str | None) -> GgufConfig:
    """A GGUF file's blocks kept quantized (the default; "gguf_int4": its 4-bit types as
    exact int4) or dequantized at load ("none")."""
    if requested not in (None, "none", "gguf_int4"):
        raise ValueError(f"quantization={requested!r}: a GGUF file is already quantized; "
                         "leave quantization unset, 'gguf_int4' to keep its 4-bit blocks "
                         "exact, or 'none' to run it dequantized")
    types = dict(declared_quantization(None, hf_config)["tensor_types"])
    config = GgufConfig(types, dequantize=requested == "none",
                        exact_int4=requested == "gguf_int4")
    if not config.dequantize and config.dequantized_types():
        logger.info("GGUF types %s have no kept-quantized form here: their linear layers are "
                    "dequantized at load", ", ".join(sorted(config.dequantized_types())))
    return config


def checkpoint_quant_config(path: Path | None, hf_config) -> QuantConfig | None:
    """The quantization an HF checkpoint declares, in config.json's `quantization_config`
    or ModelOpt's hf_quant_config.json; None for a 16/32-bit checkpoint."""
    raw = declared_quantization(path, hf_config)
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method == "fp8":
        return hf_fp8.parse(raw)
    if method == "compressed-tensors":
        return compressed.parse(raw)
    if method.startswith("modelopt"):  # "modelopt", "modelopt_fp4"
        return modelopt.parse(raw)
    if method == "awq":
        return awq.parse(raw)
    if method == "gptq":
        return gptq.parse(raw)
    if method == "mxfp4":
        return mxfp4.parse(raw)
    raise CheckpointError(f"quantization format {method or raw!r} is not supported; "
                          f"{SUPPORTED}")


def declared_quantization(path: Path | None, hf_config) -> dict | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    modelopt_file = path / "hf_quant_config.json" if path is not None else None
    if raw is None and modelopt_file is not None and modelopt_file.is_file():
        try:
            raw = {"quant_method": "modelopt", **json.loads(modelopt_file.read_text())}
        except (json.JSONDecodeError, TypeError) as exc:
            raise CheckpointError(f"{modelopt_file} is not a JSON object: {exc}") from None
    return raw
