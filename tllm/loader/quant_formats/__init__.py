"""The quantized checkpoint formats tllm reads, one module each: `parse(raw)` turns the
checkpoint's own quantization config (a dict) into a QuantConfig, or refuses a scheme the
format can hold but tllm cannot run with one error that names it (`unsupported`)."""
from __future__ import annotations

from tllm.loader.hf import CheckpointError

SUPPORTED = ("supported: fp8 e4m3 as Hugging Face quant_method 'fp8' (block-wise "
             "weight_scale_inv, or per-tensor scales), compressed-tensors float-quantized "
             "(channel, tensor or block weight scales; dynamic or static per-tensor "
             "activations), ModelOpt FP8 and FP8_PER_CHANNEL_PER_TOKEN; AWQ 4-bit GEMM "
             "packing; GPTQ 4/8-bit (gptq, gptq_v2 formats; sym or not; desc_act or not); "
             "MXFP4 experts (GPT-OSS)")


def unsupported(fmt: str, scheme: str) -> CheckpointError:
    return CheckpointError(f"quantization format {fmt} with {scheme} is not supported; "
                           f"{SUPPORTED}")
