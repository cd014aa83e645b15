"""Quantization methods of linear layers (base.py: the interface; fp8.py: FP8 W8A8; gguf.py:
GGUF block formats kept quantized)."""
from torch import nn

from tllm.layers.embedding import Embedding, LMHead
from tllm.layers.quant.base import (UNQUANTIZED, ParamLayout, QuantConfig, QuantMethod,
                                    UnquantizedMethod, linear_method)


def embedding_layer(quant_config: QuantConfig | None, vocab_size: int,
                    hidden_size: int) -> nn.Module:
    """The token embedding: the scheme's own (kept quantized) where it has one, else plain."""
    own = getattr(quant_config, "embedding_layer", None)
    layer = own(vocab_size, hidden_size) if own is not None else None
    return layer if layer is not None else Embedding(vocab_size, hidden_size)


def lm_head_layer(quant_config: QuantConfig | None, vocab_size: int, hidden_size: int,
                  tied: bool) -> nn.Module:
    """The LM head: the scheme's own where it has one, else plain. A tied head shares the
    embedding's parameter either way (the model ties them)."""
    own = getattr(quant_config, "lm_head_layer", None)
    layer = own(vocab_size, hidden_size, tied) if own is not None else None
    return layer if layer is not None else LMHead(vocab_size, hidden_size)


__all__ = ["UNQUANTIZED", "ParamLayout", "QuantConfig", "QuantMethod", "UnquantizedMethod",
           "embedding_layer", "linear_method", "lm_head_layer"]
