"""AWQ (`quant_method: "awq"`, AutoAWQ / transformers' AwqConfig): 4-bit weights with zero
points, GEMM packing ("version" / "format": "gemm"); `group_size` (-1: one group per output
row) and `modules_to_not_convert` (a layer is kept in the model dtype when an entry is a
substring of its name, as transformers matches it)."""
from __future__ import annotations

from tllm.layers.quant.awq import AwqLinearMethod
from tllm.layers.quant.woq import WoqConfig
from tllm.loader.quant_formats import unsupported

FORMAT = "AWQ"
OTHER_VERSIONS = ("gemv", "gemv_fast", "llm-awq", "marlin", "exllama", "ipex")


def parse(raw: dict) -> WoqConfig:
    version = str(raw.get("version") or raw.get("format") or "gemm").lower()
    if version != "gemm":
        raise unsupported(FORMAT, f"version {version!r} (only 'gemm' packing is read; "
                          f"{', '.join(OTHER_VERSIONS)} are not)")
    bits = raw.get("bits", raw.get("w_bit", 4))
    if bits != 4:
        raise unsupported(FORMAT, f"{bits}-bit weights")
    if not raw.get("zero_point", True):
        raise unsupported(FORMAT, "zero_point=false (symmetric)")
    group = int(raw.get("group_size", raw.get("q_group_size", 128)))
    skip = tuple(raw.get("modules_to_not_convert") or ())
    return WoqConfig(name="awq", make_method=lambda: AwqLinearMethod(group),
                     is_ignored=lambda name: any(key in name for key in skip))
