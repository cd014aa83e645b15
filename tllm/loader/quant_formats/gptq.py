"""GPTQ (`quant_method: "gptq"`, AutoGPTQ / GPTQModel / optimum, transformers' GPTQConfig):
4 or 8 bits, symmetric or not (`sym`), with or without act-order (`desc_act`), `group_size`
(-1: one group per output row). `checkpoint_format` (or GPTQModel's `format`) "gptq" (v1,
the default) stores zero points minus one, "gptq_v2" as they are; "marlin" and others are
refused. Layers outside `modules_in_block_to_quantize` (when given) stay in the model dtype;
`dynamic` per-module overrides and a quantized LM head are refused."""
from __future__ import annotations

from tllm.layers.quant.gptq import GptqLinearMethod
from tllm.layers.quant.woq import WoqConfig
from tllm.loader.quant_formats import unsupported

FORMAT = "GPTQ"
FORMATS = {"gptq": True, "gptq_v2": False}   # -> zero points stored minus one


def parse(raw: dict) -> WoqConfig:
    fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if fmt not in FORMATS:
        raise unsupported(FORMAT, f"checkpoint_format {fmt!r} (read: gptq, gptq_v2)")
    bits = raw.get("bits", 4)
    if bits not in (4, 8):
        raise unsupported(FORMAT, f"{bits}-bit weights (4 and 8 are read)")
    if raw.get("dynamic"):
        raise unsupported(FORMAT, "per-module 'dynamic' overrides")
    if raw.get("lm_head"):
        raise unsupported(FORMAT, "a quantized lm_head")
    group = int(raw.get("group_size", 128))
    minus_one = FORMATS[fmt]
    blocks = raw.get("modules_in_block_to_quantize")
    listed = {name for block in blocks for name in block} if blocks else None
    return WoqConfig(name="gptq",
                     make_method=lambda: GptqLinearMethod(bits, group, minus_one),
                     is_ignored=lambda name: _outside(name, listed))


def _outside(name: str, listed: set[str] | None) -> bool:
    """A layer is quantized unless a block list is given and does not name it
    ("self_attn.q_proj" for "model.layers.3.self_attn.q_proj")."""
    if listed is None:
        return False
    return not any(name.endswith("." + entry) for entry in listed)
