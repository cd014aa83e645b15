"""The transformers fallback: any decoder-only causal LM in transformers, run by its own
modeling code, with our paged KV cache and attention backends in place of its attention
(`transformers_attention.py`). Slower than a native model (no fused layers, HF's Python per
layer), but the engine's features all work: continuous batching, chunked prefill, prefix
reuse, the server.

The engine hands us flattened tokens; HF sees them as one batch row [1, T] with their own
positions, so HF's rotary embedding rotates each token by its position in its sequence, and
attention (ours) keeps the sequences apart by the step's metadata."""
from __future__ import annotations

import copy
import inspect
import re
from typing import Iterable, Iterator

import torch
import transformers
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                             rename_source_key)
from transformers.initialization import no_init_weights
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tllm.attention.interface import (AttentionBackend, AttentionMetadata, AttentionOptions,
                                      KVCache, KVCacheSpec)
from tllm.distributed import comm
from tllm.layers.linear import _copy_checked
from tllm.layers.quant import QuantConfig
from tllm.models.registry import supported_architectures
from tllm.models.transformers_attention import (ATTENTION_IMPL, ATTENTION_LAYER_TYPES,
                                                STEP_KWARG, AttentionProbe, LayerAttention,
                                                PagedStep, UnservableModel)

_PROBE_TOKENS = 2


class TransformersCausalLM(nn.Module):
    """An HF `...ForCausalLM` behind the interface the engine expects of a model."""

    is_first_stage = True
    is_last_stage = True

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        hf_cls = causal_lm_class(config)
        refuse_unservable(config, hf_cls, quant_config)
        self.config = config
        self.quant_config = quant_config
        self.activation_dtype = torch.get_default_dtype()
        hf_config = copy.deepcopy(config)  # transformers writes dtype and attention into it
        self.hf = build_hf_model(hf_cls, hf_config, self.activation_dtype)
        # not a submodule: it shares every module of self.hf
        self.__dict__["_head"] = _logits_head(self.hf, self.hf.base_model_prefix)
        self.layer_attention = probe_attention(self.decoder, hf_config)
        self.backends = _layer_backends(self.layer_attention, backend_cls)
        self._check_logits_head()

    @property
    def decoder(self) -> nn.Module:
        """The HF base model: embeddings, decoder layers, final norm."""
        return getattr(self.hf, self.hf.base_model_prefix)

    @property
    def num_local_layers(self) -> int:
        return len(self.layer_attention)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """One head shape for all layers, and each layer's window (so the cache can give
        back the blocks a window has passed)."""
        first = self.layer_attention[0]
        windows = tuple(a.options.sliding_window for a in self.layer_attention)
        return KVCacheSpec(self.num_local_layers, first.num_kv_heads, first.head_dim, windows)

    def attention_options(self, layer: int) -> AttentionOptions:
        """Layer `layer`'s window, scale and soft-cap, as the HF model passes them."""
        return self.layer_attention[layer].options

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, intermediate=None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the HF base model's final norm."""
        step = PagedStep(kv_caches, metadata, self.backends)
        out = self.decoder(input_ids=input_ids[None], position_ids=metadata.positions[None],
                           use_cache=False, **{STEP_KWARG: step})
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(inputs_embeds=hidden[None], use_cache=False).logits[0]

    @torch.inference_mode()
    def _check_logits_head(self) -> None:
        hidden = torch.zeros(1, self.config.get_text_config().hidden_size,
                             device=next(self.parameters()).device)
        try:
            logits = self.compute_logits(hidden)
        except Exception as exc:  # whatever HF's head code trips on, say it at load
            raise UnservableModel(
                f"{type(self.hf).__name__}'s logits cannot be computed apart from its base "
                f"model ({type(exc).__name__}: {exc})") from exc
        if logits.dim() != 2 or logits.shape[0] != 1:
            raise UnservableModel(f"{type(self.hf).__name__}'s head returns logits of shape "
                                  f"{tuple(logits.shape)} for one token; expected [1, vocab]")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the HF module by name, mapped as transformers maps
        them (legacy renamings; per-expert tensors merged). Returns the names of every
        parameter filled; a tied tensor counts under all its names."""
        names = CheckpointNames(self.hf)
        state = self.hf.state_dict(keep_vars=True)
        aliases = _aliases(self.hf)
        loaded: set[str] = set()

        def place(target: str, tensor: torch.Tensor, source: str) -> None:
            _copy_checked(state[target], tensor, source)
            loaded.update(aliases.get(target, {target}))

        for name, tensor in weights:
            target = names.target(name, tensor, state)
            if target is not None:
                place(target, tensor, name)
        for target, tensor in names.merged(self.hf):
            if target not in state:
                raise ValueError(f"transformers' conversion made {target!r}, which has no "
                                 f"place in {names.arch}")
            place(target, tensor, target)
        return loaded

    def expected_weights(self) -> set[str]:
        """Every parameter a complete checkpoint fills (a tied one once)."""
        return {name for name, _ in self.hf.named_parameters()}


@torch.no_grad()
def build_hf_model(hf_cls: type[nn.Module], config, dtype: torch.dtype) -> nn.Module:
    """The HF model with its buffers (rotary tables) set and its embeddings tied, and its
    parameters zero until the checkpoint fills them: HF's random init of every weight takes
    seconds per billion parameters on a CPU, for nothing."""
    with no_init_weights():
        hf = hf_cls._from_config(config, attn_implementation=ATTENTION_IMPL, dtype=dtype)
    for param in hf.parameters():
        param.zero_()  # not torch.empty's leftovers: the probe runs on these
        param._is_hf_initialized = True  # so HF's init below sets the buffers only
    hf.init_weights()
    return hf.to(torch.get_default_device()).eval()


class _HiddenStates(nn.Module):
    """Stands in for the base model when the HF causal LM computes logits: its output is
    the hidden states it is given. Head code reaches base models in a few ways (OPT calls
    `self.model.decoder`, GPT-2 passes input_ids first, MoE heads read `router_logits`):
    any attribute of the stand-in is the stand-in, any field of its output not set is
    None. A head it cannot stand in for fails at load (`_check_logits_head`)."""

    def forward(self, *args, inputs_embeds: torch.Tensor, **kwargs):
        return _PassedThrough(last_hidden_state=inputs_embeds)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return self


class _PassedThrough(BaseModelOutputWithPast):
    """The stand-in's output: fields a head reads that it never sets are None."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _logits_head(hf: nn.Module, prefix: str) -> nn.Module:
    """A shallow copy of the HF causal LM whose base model passes hidden states through:
    calling it runs exactly the model's own LM head and logit scaling (Cohere multiplies,
    Granite divides, Gemma soft-caps), with the same weights."""
    head = copy.copy(hf)
    head._modules = {**hf._modules, prefix: _HiddenStates()}
    return head


def causal_lm_class(config) -> type[nn.Module]:
    """The transformers class named by the config's `architectures`, if it is a causal LM."""
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if getattr(config, "is_encoder_decoder", False):
        raise UnservableModel(f"{arch} is an encoder-decoder model; the transformers fallback "
                              "serves decoder-only causal LMs")
    if not hasattr(transformers, arch):
        raise UnservableModel(
            f"unsupported model architecture {arch!r}: neither tllm (which implements "
            f"{', '.join(supported_architectures())}) nor transformers "
            f"{transformers.__version__} has it")
    if arch not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise UnservableModel(f"{arch} is not a decoder-only causal LM in transformers "
                              f"{transformers.__version__}; the transformers fallback serves "
                              "those (AutoModelForCausalLM's classes) only")
    return getattr(transformers, arch)


def refuse_unservable(config, hf_cls: type[nn.Module], quant_config) -> None:
    """Reasons known from the config alone: the rest shows in the probe."""
    arch = hf_cls.__name__
    mapping = comm.mapping()
    if mapping.tp_size > 1 or mapping.pp_size > 1:
        raise ValueError(f"{arch} runs on transformers' modeling code, on one rank only: "
                         f"tensor_parallel_size={mapping.tp_size} and pipeline_parallel_size="
                         f"{mapping.pp_size} are not supported with it (use 1 and 1)")
    if quant_config is not None:
        raise ValueError(f"{arch} runs on transformers' modeling code, unquantized only: "
                         f"{type(quant_config).__name__} is not supported with it")
    if config.get_text_config() is not config:
        raise UnservableModel(f"{arch} is a multimodal model; the transformers fallback "
                              "serves text-only decoders")
    if not getattr(hf_cls, "_supports_attention_backend", False):
        raise UnservableModel(f"{arch}'s modeling code does not take a custom attention "
                              "function (transformers' _supports_attention_backend is off)")
    others = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if others:
        raise UnservableModel(f"{arch} has {', '.join(others)} layers, whose state our paged "
                              "KV cache cannot hold (it holds full and sliding-window attention)")
    if getattr(config, "attention_chunk_size", None):
        raise UnservableModel(f"{arch} attends in chunks (attention_chunk_size), which our "
                              "attention backends do not do")


@torch.inference_mode()
def probe_attention(decoder: nn.Module, config) -> list[LayerAttention]:
    """Run the base model once on two tokens and check that every layer attends through our
    function, each once, with one KV head shape: the layers' attention, by layer index."""
    arch = type(decoder).__name__
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        raise UnservableModel(f"{arch} takes no position_ids, so the sequences of a batch, "
                              "flattened into one row, would be numbered as one")
    device = next(decoder.parameters()).device
    probe = AttentionProbe(config, _PROBE_TOKENS)
    ids = torch.ones(1, _PROBE_TOKENS, dtype=torch.long, device=device)
    decoder(input_ids=ids, position_ids=torch.arange(_PROBE_TOKENS, device=device)[None],
            use_cache=False, **{STEP_KWARG: probe})
    num_layers = getattr(config, "num_hidden_layers", None) or len(probe.layers)
    if sorted(probe.layers) != list(range(num_layers)):
        silent = sorted(set(range(num_layers)) - set(probe.layers))
        raise UnservableModel(
            f"{arch}: layers {silent or sorted(probe.layers)} of {num_layers} do not attend "
            "as layers 0..n-1 through transformers' attention interface (recurrent or "
            "state-space layers?), so their state cannot live in our paged KV cache")
    layers = [probe.layers[i] for i in range(num_layers)]
    shapes = {(a.num_kv_heads, a.head_dim) for a in layers}
    if len(shapes) > 1:
        raise UnservableModel(f"{arch}: layers with different KV head shapes {sorted(shapes)}; "
                              "our paged cache holds one shape for all layers")
    return layers


def _layer_backends(layers: list[LayerAttention],
                    backend_cls: type[AttentionBackend]) -> list[AttentionBackend]:
    """One backend object per distinct head shape and options, shared by its layers."""
    backends: dict[tuple, AttentionBackend] = {}
    for a in layers:
        key = (a.num_heads, a.num_kv_heads, a.head_dim, a.options)
        if key not in backends:
            o = a.options
            backends[key] = backend_cls(a.num_heads, a.num_kv_heads, a.head_dim,
                                        o.scale or a.head_dim ** -0.5, o.sliding_window,
                                        logits_soft_cap=o.logits_soft_cap)
    return [backends[(a.num_heads, a.num_kv_heads, a.head_dim, a.options)] for a in layers]


def _aliases(module: nn.Module) -> dict[str, set[str]]:
    """Name -> every name of the same tensor (tied embeddings have two)."""
    by_tensor: dict[int, set[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), set()).add(name)
    return {name: names for names in by_tensor.values() for name in names}


class CheckpointNames:
    """Checkpoint tensor name -> the HF module's state-dict name, as transformers maps it
    when it loads: its renamings of legacy names, the base-model prefix added or dropped,
    and its converters (per-expert tensors stacked into one, a fused tensor split), whose
    source tensors are held until every one has arrived."""

    def __init__(self, hf: nn.Module) -> None:
        transforms = get_model_conversion_mapping(hf)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.converter_of = {p: c for c in self.converters for p in c.source_patterns}
        self.prefix = hf.base_model_prefix
        self.ignored = [re.compile(p) for p in (hf._keys_to_ignore_on_load_unexpected or ())]
        self.arch = type(hf).__name__
        # converted target -> its (checkpoint name, source pattern, tensor)s
        self.pending: dict[str, list[tuple[str, str, torch.Tensor]]] = {}

    def target(self, name: str, tensor: torch.Tensor,
               state: dict[str, torch.Tensor]) -> str | None:
        """The state-dict name `name` loads into as it is; None for a tensor HF skips too,
        or one held for a converter (`merged`)."""
        renamed, pattern = rename_source_key(name, self.renamings, self.converters,
                                             self.prefix, state)
        if renamed not in state and name in state:  # renamed where it should not have been
            renamed, pattern = name, None
        if renamed in state and pattern is not None:
            self.pending.setdefault(renamed, []).append((name, pattern, tensor))
            return None
        if renamed in state:
            return renamed
        if "rotary_emb.inv_freq" in name or any(p.search(name) for p in self.ignored):
            return None
        raise ValueError(f"checkpoint tensor {name!r} has no place in {self.arch}")

    def merged(self, hf: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The converters' outputs, once every checkpoint tensor has been read."""
        for target, sources in self.pending.items():
            converter = copy.deepcopy(self.converter_of[sources[0][1]])
            # stacked in checkpoint order (experts.2 before experts.10), as HF sorts them
            for name, pattern, tensor in sorted(sources, key=lambda s: dot_natural_key(s[0])):
                converter.add_tensor(target, name, pattern, lambda t=tensor: t)
            for key, value in converter.convert(target, model=hf, config=hf.config).items():
                yield key, value[0] if isinstance(value, list) else value
        self.pending.clear()
