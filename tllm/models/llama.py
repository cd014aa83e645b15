"""Llama-family decoder (Llama, Mistral, SmolLM2), the base for Qwen2 and Qwen3.

Works on flattened tokens: [num_tokens] ids in, [num_tokens, hidden] states out; the paged
KV cache and the per-step AttentionMetadata are passed down explicitly.

Under tensor parallelism each rank builds its shard (heads and MLP columns split, vocab
split); under pipeline parallelism each rank builds only its stage's layers, plus the
embedding on the first stage and the final norm and LM head on the last."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tllm.attention.interface import (AttentionBackend, AttentionMetadata, AttentionOptions,
                                      KVCache, KVCacheSpec)
from tllm.layers.activation import SiluAndMul
from tllm.layers.dense_gemv_dispatch import gate_up_silu_mul
from tllm.distributed import comm
from tllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear, _copy_checked
from tllm.layers.norm import RMSNorm
from tllm.layers.quant import QuantConfig, embedding_layer, linear_method, lm_head_layer
from tllm.layers.quant.fp8 import input_quantization
from tllm.layers.rotary import RotaryEmbedding, rotary_embedding
from tllm.models.registry import register_model


QKV_SHARDS = ("q_proj", "k_proj", "v_proj")
GATE_UP_SHARDS = ("gate_proj", "up_proj")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "self_attn") -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            bias=bias,
            quant=linear_method(quant_config, f"{prefix}.qkv_proj", QKV_SHARDS))
        self.num_heads = self.qkv_proj.num_heads        # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size,
                                        bias=getattr(config, "attention_bias", False),
                                        quant=linear_method(quant_config, f"{prefix}.o_proj"))
        # per-tensor scales of an fp8 KV cache (real = fp8 * scale); the checkpoint's, or 1
        self.kv_scales = (1.0, 1.0)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = backend

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.attend(q, k, v, kv_cache, metadata)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               metadata: AttentionMetadata) -> torch.Tensor:
        """This rank's flat q, k, v [T, heads * head_dim] -> heads, q/k norms, rotary,
        attention over the cache, output projection."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # a learned logit per head (GPT-OSS's attention sinks), where the model has them
        sinks = getattr(self, "sinks", None)
        extra = {} if sinks is None else {"sinks": sinks}
        if self.qk_norm:  # the backend may fuse them into its rotation
            extra["qk_norm"] = (self.q_norm, self.k_norm)
        out = self.attn.forward_with_rope(q, k, v, kv_cache, metadata, self.rotary,
                                          self.kv_scales, **extra)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config, quant_config: QuantConfig | None = None,
                 prefix: str = "mlp", intermediate_size: int | None = None) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # the merged gate/up kernel applies SiLU
            raise ValueError(f"hidden_act {act!r} is not supported by the Llama-family MLP "
                             "(silu only); model_impl='transformers' runs such a model")
        # a MoE model's shared expert has its own size
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [inter, inter], bias=bias,
            quant=linear_method(quant_config, f"{prefix}.gate_up_proj", GATE_UP_SHARDS))
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=bias,
            quant=linear_method(quant_config, f"{prefix}.down_proj"))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = gate_up_silu_mul(self.gate_up_proj, self.act, self.down_proj, x)
        if fused is not None:  # batch-1 decode: gate_up and SiLU-and-mul in one GEMV
            return self.down_proj(fused)
        h = self.gate_up_proj(x)
        return self.down_proj(self.act(h, quantize_to=input_quantization(self.down_proj, h)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "layers.0") -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary, backend, quant_config,
                                            f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
        """The feed-forward block (a mixture of experts overrides this)."""
        return LlamaMLP(config, quant_config, prefix)

    @staticmethod
    def layer_index(prefix: str) -> int:
        return int(prefix.rsplit(".", 1)[-1])

    def forward(self, hidden, residual, kv_cache: KVCache, metadata: AttentionMetadata):
        # an FP8 projection may take its input quantized by the norm's kernel (None: as is)
        fp8_in = input_quantization(self.self_attn.qkv_proj, hidden)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quantize_to=fp8_in)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quantize_to=fp8_in)
        hidden = self.self_attn(hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(
            hidden, residual, quantize_to=input_quantization(
                getattr(self.mlp, "gate_up_proj", None), hidden))
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A layer that lives on another pipeline stage: keeps the layer indices of the
    checkpoint, holds no weights."""


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    # checkpoint projection name -> (merged parameter, shard index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        # the hidden states' dtype (what pipeline stages send), whatever the weights are kept in
        self.activation_dtype = torch.get_default_dtype()
        mapping = comm.mapping()
        self.is_first_stage, self.is_last_stage = mapping.is_first_stage, mapping.is_last_stage
        self.stage_layers = mapping.stage_layers(config.num_hidden_layers)
        self.layers = nn.ModuleList(MissingLayer() for _ in range(config.num_hidden_layers))
        rotaries: dict[str | None, RotaryEmbedding] = {}
        for i in self.stage_layers:
            kind = self.rope_kind(i)  # layers of one kind share one rotary table
            if kind not in rotaries:
                rotaries[kind] = self.make_rotary(kind, max_position)
            self.layers[i] = self.layer_cls(config, rotaries[kind], None, quant_config,
                                            f"layers.{i}")
        backends: dict[AttentionOptions, AttentionBackend] = {}
        for i in self.stage_layers:  # one backend object per kind of layer
            attn, options = self.layers[i].self_attn, self.attention_options(i)
            if options not in backends:
                backends[options] = self.make_attention_backend(backend_cls, attn, options)
            attn.attn = backends[options]
        self.tied = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = (embedding_layer(quant_config, config.vocab_size, config.hidden_size)
                             if self.is_first_stage else MissingLayer())
        if self.is_last_stage:
            self.norm = self.make_final_norm(config)
            self.lm_head = lm_head_layer(quant_config, config.vocab_size, config.hidden_size,
                                         self.tied)
            if self.tied and self.is_first_stage:
                self.lm_head.weight = self.embed_tokens.weight

    def make_attention_backend(self, backend_cls: type[AttentionBackend], attn: nn.Module,
                               options: AttentionOptions):
        """The backend object the layers of one kind (`options`) share."""
        return backend_cls(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           options.scale or attn.head_dim ** -0.5, options.sliding_window,
                           logits_soft_cap=options.logits_soft_cap)

    def make_final_norm(self, config) -> nn.Module:
        """The norm after the last layer; called with (hidden, residual), it adds them."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rope_kind(self, layer: int) -> str | None:
        """Which rotary table a layer uses: its `layer_types` entry where the config gives
        each kind its own rope parameters (Gemma 3), else None (one table for all)."""
        params = getattr(self.config, "rope_parameters", None) or {}
        types = getattr(self.config, "layer_types", None)
        if types and types[layer] in params and isinstance(params[types[layer]], dict):
            return types[layer]
        return None

    def make_rotary(self, kind: str | None, max_position: int) -> RotaryEmbedding:
        return rotary_embedding(self.config, head_dim_of(self.config), max_position, kind)

    def attention_options(self, layer: int) -> AttentionOptions:
        """Layer `layer`'s sliding window, softmax scale and logit soft-cap. The window is
        the config's `sliding_window` on the layers `layer_types` marks as sliding (every
        layer when it has no `layer_types`, unless `use_sliding_window` is off)."""
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            window = window if types[layer] == "sliding_attention" else None
        elif not getattr(self.config, "use_sliding_window", True):
            window = None
        return AttentionOptions(sliding_window=window)

    @property
    def num_local_layers(self) -> int:
        return len(self.stage_layers)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's KV cache: its stage's layers, its share of the kv heads, and every
        layer's sliding window (the cache drops what a window has passed)."""
        attn = self.layers[self.stage_layers.start].self_attn
        windows = tuple(self.attention_options(i).sliding_window
                        for i in range(self.config.num_hidden_layers))
        return KVCacheSpec(self.num_local_layers, attn.num_kv_heads, attn.head_dim,
                           windows, self.stage_layers.start)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input hidden states (a model that scales its embeddings, as
        Gemma does, overrides this)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, kv_caches: list[KVCache],
                metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Hidden states after the last layer (last stage), or (hidden, residual) to hand
        to the next stage. Stages after the first start from `intermediate`. A
        vision-language model's `mm_embeds` (rows, image embeddings) replace those rows'
        token embeddings."""
        if self.is_first_stage:
            hidden, residual = self.embed(input_ids), None
            if mm_embeds is not None:
                rows, embeds = mm_embeds
                hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        else:
            hidden, residual = intermediate
        for i, kv_cache in zip(self.stage_layers, kv_caches):  # each with its group's tables
            hidden, residual = self.layers[i](hidden, residual, kv_cache,
                                              metadata.for_layer(i))
        if not self.is_last_stage:
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, unsplit) into this rank's parameters, each
        layer keeping its shard; tensors of other stages are skipped. Returns what was
        loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        # a quantization format's names for a linear layer's tensors -> the method's
        aliases = dict(getattr(self.quant_config, "param_aliases", ()))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            module_path, _, leaf = name.rpartition(".")
            if leaf in aliases:
                name = f"{module_path}.{aliases[leaf]}"
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith((".k_scale", ".v_scale")):
                self._load_kv_scale(name, tensor)
                continue
            if (name == "embed_tokens.weight" and self.tied and self.is_last_stage
                    and not self.is_first_stage):
                self.lm_head.load_weight("weight", tensor)  # the tied head on the last stage
                loaded.add("lm_head.weight#None")
            target, shard = self._map_name(name)
            if target not in params:
                if self._on_other_stage(target):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            module_name, param_name = target.rsplit(".", 1)
            module = self.get_submodule(module_name)
            param = params[target]
            if tensor.dim() == 1 and param.dim() == 2 and param.shape[1] == 1:
                tensor = tensor[:, None]  # a per-channel scale stored flat (ModelOpt)
            if shard is not None:
                module.load_shard(param_name, shard, tensor)
            elif hasattr(module, "load_weight"):
                module.load_weight(param_name, tensor)
            else:
                _copy_checked(params[target], tensor, name)
            loaded.add(f"{target}#{shard}")
        return loaded

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """An fp8 KV cache's per-tensor scale: `layers.N.self_attn.k_scale` (or, as ModelOpt
        writes it, `layers.N.self_attn.k_proj.k_scale`)."""
        index = int(name.split(".")[1])
        if index not in self.stage_layers:
            return
        attn = self.layers[index].self_attn
        k_scale, v_scale = attn.kv_scales
        value = float(tensor.float().max())
        attn.kv_scales = (value, v_scale) if name.endswith("k_scale") else (k_scale, value)

    def _on_other_stage(self, target: str) -> bool:
        if target.startswith("layers."):
            return int(target.split(".")[1]) not in self.stage_layers
        return target.split(".")[0] in ("embed_tokens", "norm", "lm_head")

    def _map_name(self, name: str) -> tuple[str, int | None]:
        for ckpt_name, (merged, shard) in self.stacked_params.items():
            if f".{ckpt_name}." in name:
                return name.replace(ckpt_name, merged), shard
        return name, None

    def expected_weights(self) -> set[str]:
        """The keys load_weights must have produced for a complete checkpoint."""
        expected = set()
        for module_name, module in self.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                shards = len(module.output_sizes) if isinstance(module, MergedLinear) else 0
                expected.update({f"{full}#{i}" for i in range(shards)} or {f"{full}#None"})
        if self.tied and self.is_first_stage:
            expected.discard("lm_head.weight#None")
        return expected
