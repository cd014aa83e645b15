"""Encoder-only models: BERT and XLM-RoBERTa (embedders), and their sequence-classification
forms (cross-encoder rerankers).

Post-norm layers with learned absolute positions and token types; attention is
bidirectional (the backend's non-causal mode), so a prompt is computed in one step, never in
chunks. Keys and values still go through the paged KV cache like any model's (the blocks are
freed when the request ends). Modules keep HF's names, so checkpoints load by name. One
rank only: the layers are plain torch modules, not tensor-parallel ones."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache, KVCacheSpec
from tllm.distributed import comm
from tllm.models.registry import register_model

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class BertEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:
            token_type_ids = torch.zeros_like(input_ids)  # (RoBERTa has one type)
        hidden = (self.word_embeddings(input_ids)
                  + self.position_embeddings(positions + self.position_offset)
                  + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)


class BertDenseNorm(nn.Module):
    """A projection, then LayerNorm over it plus the residual (HF's *Output modules)."""

    def __init__(self, in_size: int, config) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config.hidden_size, config)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.attn: AttentionBackend | None = None  # shared by every layer, set by the model

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        shape = (-1, self.num_heads, self.head_dim)
        q, k, v = (proj(hidden).view(shape)
                   for proj in (self.self.query, self.self.key, self.self.value))
        out = self.attn.forward(q, k, v, kv_cache, metadata)
        return self.output(out.flatten(1), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        act = config.hidden_act
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported by the BERT encoder")
        self.act = _ACTIVATIONS[act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config.intermediate_size, config)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, kv_cache, metadata)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """tanh(dense(the first token's state)): what BertForSequenceClassification classifies."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(pooled))


@register_model("BertModel")
class BertModel(nn.Module):
    """The encoder; its final hidden states are what the pooler reads (an embedder: CLS or
    mean pooling, per its sentence-transformers layout)."""

    pooling_task = "embed"
    default_pooling = "cls"
    is_causal = False
    checkpoint_prefixes = ("bert.", "model.")
    with_pooler = False        # BertModel's own pooler is not part of an embedding

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config=None) -> None:
        super().__init__()
        self.check_one_rank(quant_config)
        self.config = config
        self.activation_dtype = torch.get_default_dtype()
        self.is_first_stage = self.is_last_stage = True
        self.embeddings = BertEmbeddings(config, self.position_offset(config))
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if self.with_pooler else None
        head_dim = config.hidden_size // config.num_attention_heads
        backend = backend_cls(config.num_attention_heads, config.num_attention_heads,
                              head_dim, head_dim ** -0.5, causal=False)
        for layer in self.encoder.layer:
            layer.attention.attn = backend

    def check_one_rank(self, quant_config) -> None:
        if quant_config is not None:
            raise ValueError(f"quantization: {type(self).__name__} runs unquantized")
        if comm.mapping().world_size > 1:
            raise ValueError(f"{type(self).__name__} runs on one rank (tp_size and pp_size 1)")

    @staticmethod
    def position_offset(config) -> int:
        return 0

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt its learned positions cover."""
        return self.config.max_position_embeddings - self.position_offset(self.config)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return KVCacheSpec(self.config.num_hidden_layers, self.config.num_attention_heads,
                           head_dim)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, intermediate=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, metadata.positions, token_type_ids)
        for layer, kv_cache in zip(self.encoder.layer, kv_caches):
            hidden = layer(hidden, kv_cache, metadata)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder generates nothing: no rows (the loop asks only for steps without
        sampling requests)."""
        return hidden.new_empty((hidden.shape[0], 0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for prefix in self.checkpoint_prefixes:
                name = name.removeprefix(prefix)
            if name.endswith("position_ids") or (name.startswith("pooler.")
                                                 and self.pooler is None):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}


@register_model("XLMRobertaModel", "RobertaModel")
class XLMRobertaModel(BertModel):
    """BERT with positions counted from the pad id + 1 (RoBERTa's rule for a prompt
    without padding)."""

    checkpoint_prefixes = ("roberta.", "model.")

    @staticmethod
    def position_offset(config) -> int:
        return config.pad_token_id + 1


def _num_labels(config) -> int:
    return config.num_labels


@register_model("BertForSequenceClassification")
class BertForSequenceClassification(BertModel):
    """A cross-encoder (one label: a pair's relevance) or a classifier: the classifier over
    the pooler's tanh(dense(CLS))."""

    pooling_task = "score"
    with_pooler = True

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.classifier = nn.Linear(config.hidden_size, _num_labels(config))
        if _num_labels(config) > 1:
            self.pooling_task = "classify"

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(pooled))


class RobertaClassificationHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, _num_labels(config))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(pooled)))


@register_model("XLMRobertaForSequenceClassification", "RobertaForSequenceClassification")
class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder (bge-reranker): RoBERTa's classification head over CLS."""

    pooling_task = "score"

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.classifier = RobertaClassificationHead(config)
        if _num_labels(config) > 1:
            self.pooling_task = "classify"

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)
