"""`quant_method: "mxfp4"`: GPT-OSS's checkpoints, the experts' gate_up and down weights as
MXFP4 `*_blocks` and `*_scales` (tllm.layers.quant.mxfp4), everything else 16-bit."""
from __future__ import annotations

from tllm.layers.quant.mxfp4 import Mxfp4Config


def parse(raw: dict) -> Mxfp4Config:
    """transformers' Mxfp4Config as the checkpoint declares it. Its `modules_to_not_convert`
    (attention, router, embedding, LM head) is what tllm keeps unquantized anyway, and its
    `dequantize` is a load option of transformers', not part of the format."""
    return Mxfp4Config()
