"""Decoder models that pool instead of generating: embedders saved without an LM head
(`Qwen2Model`, `Qwen3Model`, `LlamaModel` checkpoints, as Qwen3-Embedding's
sentence-transformers folders are; last-token pooling), and sequence classifiers / reward
models (`*ForSequenceClassification`: a `score` projection of the last token's state)."""
from __future__ import annotations

import torch
from torch import nn

from tllm.models.llama import LlamaForCausalLM
from tllm.models.qwen2 import Qwen2DecoderLayer
from tllm.models.qwen3 import Qwen3DecoderLayer
from tllm.models.registry import register_model


@register_model("LlamaModel", "MistralModel")
class LlamaModel(LlamaForCausalLM):
    """The decoder without its LM head; its final hidden states are pooled."""

    pooling_task = "embed"
    default_pooling = "last"

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        if not (self.is_first_stage and self.is_last_stage):
            raise ValueError(f"{type(self).__name__}: pooling models run without pipeline "
                             "parallelism (pp_size 1)")
        del self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Nothing to sample from (the loop asks only for steps without sampling rows)."""
        return hidden.new_empty((hidden.shape[0], 0))

    def load_weights(self, weights):
        # an embedder saved from a *ForCausalLM may still carry its head: not needed here
        return super().load_weights((n, t) for n, t in weights if not n.startswith("lm_head."))


@register_model("Qwen2Model")
class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


@register_model("Qwen3Model")
class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


@register_model("LlamaForSequenceClassification", "MistralForSequenceClassification")
class LlamaForSequenceClassification(LlamaModel):
    """A classifier or reward model: `score` (no bias) over the last token's state."""

    pooling_task = "classify"

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


@register_model("Qwen2ForSequenceClassification")
class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    layer_cls = Qwen2DecoderLayer


@register_model("Qwen3ForSequenceClassification")
class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    layer_cls = Qwen3DecoderLayer
