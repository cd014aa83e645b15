"""Model classes by the HF `architectures` name; a model module is imported when first used."""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> module that registers it
_MODULES = {
    "LlamaForCausalLM": "tllm.models.llama",
    "MistralForCausalLM": "tllm.models.llama",
    "Qwen2ForCausalLM": "tllm.models.qwen2",
    "Qwen2_5_VLForConditionalGeneration": "tllm.models.qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "tllm.models.qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "tllm.models.qwen3_vl_moe",
    "LlavaForConditionalGeneration": "tllm.models.llava",
    "LlavaOnevisionForConditionalGeneration": "tllm.models.llava_onevision",
    "Mistral3ForConditionalGeneration": "tllm.models.mistral3",
    "Qwen3ForCausalLM": "tllm.models.qwen3",
    "MixtralForCausalLM": "tllm.models.mixtral",
    "Llama4ForCausalLM": "tllm.models.llama4",
    "Llama4ForConditionalGeneration": "tllm.models.llama4",
    "Qwen2MoeForCausalLM": "tllm.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "tllm.models.qwen3_moe",
    "Gemma2ForCausalLM": "tllm.models.gemma2",
    "Gemma3ForCausalLM": "tllm.models.gemma3",
    "Gemma3ForConditionalGeneration": "tllm.models.gemma3_vl",
    "Phi3ForCausalLM": "tllm.models.phi3",
    "GPTNeoXForCausalLM": "tllm.models.gpt_neox",
    "Olmo2ForCausalLM": "tllm.models.olmo2",
    "DeepseekV2ForCausalLM": "tllm.models.deepseek.model",
    "DeepseekV3ForCausalLM": "tllm.models.deepseek.model",
    "GptOssForCausalLM": "tllm.models.gpt_oss",
    # pooling models (embeddings, rerankers, classifiers)
    **dict.fromkeys(["LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model",
                     "LlamaForSequenceClassification", "MistralForSequenceClassification",
                     "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"],
                    "tllm.models.llama_pooling"),
    **dict.fromkeys(["BertModel", "XLMRobertaModel", "RobertaModel",
                     "BertForSequenceClassification", "XLMRobertaForSequenceClassification",
                     "RobertaForSequenceClassification"], "tllm.models.bert"),
    **dict.fromkeys(["ModernBertModel", "ModernBertForSequenceClassification"],
                    "tllm.models.modernbert"),
    "NemotronHForCausalLM": "tllm.models.nemotron_h",
    "GraniteMoeHybridForCausalLM": "tllm.models.granite_moe_hybrid",
    "Qwen3NextForCausalLM": "tllm.models.qwen3_next",
}
_CLASSES: dict[str, type[nn.Module]] = {}


def register_model(*architectures: str):
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for arch in architectures:
            _CLASSES[arch] = cls
        return cls
    return wrap


def supported_architectures() -> list[str]:
    return sorted(set(_MODULES) | set(_CLASSES))


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _CLASSES and architecture in _MODULES:
        importlib.import_module(_MODULES[architecture])
    if architecture not in _CLASSES:
        raise ValueError(f"unsupported model architecture {architecture!r}; tllm supports "
                         f"{', '.join(supported_architectures())}")
    return _CLASSES[architecture]
