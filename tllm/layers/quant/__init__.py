"""Quantization methods of linear layers (base.py: the interface; fp8.py: FP8 W8A8)."""
from tllm.layers.quant.base import (UNQUANTIZED, ParamLayout, QuantConfig, QuantMethod,
                                    UnquantizedMethod, linear_method)

__all__ = ["UNQUANTIZED", "ParamLayout", "QuantConfig", "QuantMethod", "UnquantizedMethod",
           "linear_method"]
