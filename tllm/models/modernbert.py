"""ModernBERT: a pre-norm encoder with rotary positions, GeGLU feed-forward blocks, no
biases, and every third layer global while the others attend a local window (|q - k| <=
local_attention / 2, both sides). An embedder (`ModernBertModel`) and a classifier or
cross-encoder (`ModernBertForSequenceClassification`). Like BERT here: bidirectional
attention through the paged KV cache, a prompt in one step, one rank; modules keep HF's
names."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache, KVCacheSpec
from tllm.layers.rotary import RotaryEmbedding, rotary_embedding
from tllm.models.bert import BertModel
from tllm.models.registry import register_model

_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "silu": F.silu, "relu": F.relu}


def _layer_norm(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def _activation(config):
    act = config.hidden_activation
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported by ModernBERT here")
    return _ACTIVATIONS[act]


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size,
                              bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.rotary = rotary
        self.attn: AttentionBackend | None = None   # set by the model (global or local)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.Wqkv(hidden).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.rotary(metadata.positions, q, k)
        return self.Wo(self.attn.forward(q, k, v, kv_cache, metadata).flatten(1))


class ModernBertMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                            bias=config.mlp_bias)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = _activation(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        inputs, gate = self.Wi(hidden).chunk(2, dim=-1)
        return self.Wo(self.act(inputs) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else _layer_norm(config)
        self.attn = ModernBertAttention(config, rotary)
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.mlp_norm(hidden))


@register_model("ModernBertModel")
class ModernBertModel(BertModel):
    """The encoder; mean pooling unless its sentence-transformers layout says otherwise."""

    default_pooling = "mean"
    checkpoint_prefixes = ("model.",)

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config=None) -> None:
        nn.Module.__init__(self)
        self.check_one_rank(quant_config)
        self.config = config
        self.activation_dtype = torch.get_default_dtype()
        self.is_first_stage = self.is_last_stage = True
        self.pooler = None
        head_dim = config.hidden_size // config.num_attention_heads
        max_position = config.max_position_embeddings
        kinds = config.layer_types
        rotaries = {kind: rotary_embedding(config, head_dim, max_position, kind)
                    for kind in set(kinds)}
        # HF's local mask: |q - k| <= local_attention // 2, i.e. < that + 1
        windows = {"full_attention": None, "sliding_attention": config.local_attention // 2 + 1}
        backends = {kind: backend_cls(config.num_attention_heads, config.num_attention_heads,
                                      head_dim, head_dim ** -0.5, windows[kind], causal=False)
                    for kind in set(kinds)}
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i, rotaries[kind])
                                    for i, kind in enumerate(kinds))
        for layer, kind in zip(self.layers, kinds):
            layer.attn.attn = backends[kind]
        self.final_norm = _layer_norm(config)

    @property
    def max_prompt_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return KVCacheSpec(self.config.num_hidden_layers, self.config.num_attention_heads,
                           head_dim)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, intermediate=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, metadata)
        return self.final_norm(hidden)


@register_model("ModernBertForSequenceClassification")
class ModernBertForSequenceClassification(ModernBertModel):
    """A classifier or cross-encoder: the prediction head (dense, activation, norm) and
    classifier over the CLS state or the mean (its config's `classifier_pooling`)."""

    pooling_task = "score"

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.default_pooling = config.classifier_pooling
        self.head = nn.Module()
        self.head.dense = nn.Linear(config.hidden_size, config.hidden_size,
                                    bias=config.classifier_bias)
        self.head.norm = _layer_norm(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        if config.num_labels > 1:
            self.pooling_task = "classify"
        self._head_act = _ACTIVATIONS.get(config.classifier_activation)
        if self._head_act is None:
            raise ValueError(f"classifier_activation {config.classifier_activation!r} is not "
                             "supported by ModernBERT here")

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head.norm(self._head_act(self.head.dense(pooled))))
