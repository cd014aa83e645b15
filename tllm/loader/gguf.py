"""GGUF files through the `gguf` package: an HF config built from the metadata (with the GGML
type of every tensor as its `quantization_config`), and weights under HF names: the blocks of
those tensors a quantization method keeps (tllm.layers.quant.gguf, [rows, blocks, bytes]),
the rest dequantised to float32.

Architectures (`general.architecture`) and where llama.cpp's files differ from HF checkpoints
(its convert_hf_to_gguf.py, read for each):
- llama (Llama, Mistral, SmolLM2; Mixtral when `llama.expert_count` > 0): attn_q/attn_k rows
  interleaved for ggml's rotary (undone by `unpermute_rows`; no other architecture here);
- qwen2, qwen3, olmo2 (q/k norms over whole projections), as stored;
- qwen2moe, qwen3moe and Mixtral: experts stacked ffn_{gate,up,down}_exps [E, rows, cols],
  handed over one expert at a time and dequantized at load (the MoE layer has no GGUF method);
  qwen2moe's shared expert ffn_*_shexp with its gate ffn_gate_inp_shexp; top-k weights
  renormalised for qwen3moe and Mixtral (llama.cpp's rule), or as `expert_weights_norm` says;
- gemma2, gemma3 (text): every norm stored as 1 + w; sliding-window layers in llama.cpp's
  fixed patterns (every 2nd / 6th layer global) unless `attention.sliding_window_pattern` says;
  gemma3's local layers on their own rope base (`rope.freq_base_swa`, else 10000); the softmax
  scale head_dim ** -0.5 but for the 27B models (hidden / heads), as llama.cpp has it;
- phi3: fused attn_qkv and ffn_up (gate rows then up rows), cut into their parts; longrope
  from the rope_factors_long/short tensors;
- gptneox: attn_qkv as all q rows, all k rows, all v rows (HF interleaves them per head).
Tensor names are parsed with the package's own tables (gguf.TENSOR_NAMES)."""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from tllm.layers.quant.gguf import FLOAT_TYPES, GgufConfig
from tllm.loader.hf import CheckpointError
from tllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GgufArch:
    """How one GGUF architecture maps onto an HF config and our model's tensor names."""

    architecture: str                    # the HF `architectures` entry
    model_type: str                      # transformers' config type
    extra_config: Callable[[GGUFCheckpoint], dict] = lambda checkpoint: {}
    # MODEL_TENSOR name -> HF module path(s) where it differs from _HF_NAMES (two or more:
    # a fused tensor cut into them along its rows)
    renames: dict[str, tuple[str, ...]] = field(default_factory=dict)
    permuted_qk: bool = False            # llama.cpp's interleaved rotary halves in attn_q/k
    norm_offset: float = 0.0             # Gemma: norms stored as 1 + w
    tokenizer_type: str | None = None    # for an architecture transformers' GGUF reader lacks


# MODEL_TENSOR name -> HF module path(s) under a layer ("layers.N.") or the model
_HF_NAMES = {
    "TOKEN_EMBD": ("embed_tokens",), "OUTPUT_NORM": ("norm",), "OUTPUT": ("lm_head",),
    "ATTN_NORM": ("input_layernorm",), "FFN_NORM": ("post_attention_layernorm",),
    "ATTN_POST_NORM": ("post_attention_layernorm",),
    "FFN_PRE_NORM": ("pre_feedforward_layernorm",),  # Gemma's ffn_norm
    "FFN_POST_NORM": ("post_feedforward_layernorm",),
    "ATTN_Q": ("self_attn.q_proj",), "ATTN_K": ("self_attn.k_proj",),
    "ATTN_V": ("self_attn.v_proj",), "ATTN_OUT": ("self_attn.o_proj",),
    "ATTN_QKV": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "ATTN_Q_NORM": ("self_attn.q_norm",), "ATTN_K_NORM": ("self_attn.k_norm",),
    "FFN_GATE": ("mlp.gate_proj",), "FFN_UP": ("mlp.up_proj",), "FFN_DOWN": ("mlp.down_proj",),
    "FFN_GATE_INP": ("mlp.gate",), "FFN_GATE_INP_SHEXP": ("mlp.shared_expert_gate",),
    "FFN_GATE_SHEXP": ("mlp.shared_expert.gate_proj",),
    "FFN_UP_SHEXP": ("mlp.shared_expert.up_proj",),
    "FFN_DOWN_SHEXP": ("mlp.shared_expert.down_proj",),
    "FFN_GATE_EXP": ("mlp.experts.{expert}.gate_proj",),
    "FFN_UP_EXP": ("mlp.experts.{expert}.up_proj",),
    "FFN_DOWN_EXP": ("mlp.experts.{expert}.down_proj",),
}
_EXPERTS = frozenset({"FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP"})
# float layers outside any quantization method (routers) and the experts: dequantized at load
_DEQUANTIZED = _EXPERTS | {"FFN_GATE_INP", "FFN_GATE_INP_SHEXP"}
_CONFIG_ONLY = frozenset({"ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT", "ROPE_FREQS"})  # config()


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, size: int, mtime_ns: int):
    """gguf's reader of a file (read-only memory map), kept for the next engine of this
    process: it parses every metadata field up front, ~2.5 s for a 49k-token vocabulary.
    Keyed on size and modification time too, so a replaced file is read again."""
    return _plain_array_reader()(path)


@functools.cache
def _plain_array_reader():
    """gguf's reader over the same memory map seen as a plain ndarray: it slices the map once
    per metadata value (~100k for a vocabulary), and numpy's memmap subclass bookkeeping on
    each slice was most of its time (7.0 -> 2.3 s for SmolLM2's file; fields and tensors equal)."""
    import gguf
    import numpy as np

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value) -> None:  # the view keeps the memmap (and its file) alive
            self._data = value.view(np.ndarray)

    return PlainArrayReader


class GGUFCheckpoint:
    """One GGUF file: its architecture, an HF config from its metadata, its weights."""

    def __init__(self, path: Path) -> None:
        try:
            stat = Path(path).stat()
            self.reader = _read_gguf(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
        except Exception as exc:  # the reader raises many kinds on a damaged file
            raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self.arch = self._field("general.architecture")
        self.spec = architecture_spec(self.arch, self.hparam("expert_count", 0))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.kinds = {name: self._parse(name) for name in self.tensors}
        # HF name -> GGML type name: what GgufConfig chooses each layer's form from (experts
        # and routers are not among them: dequantized whatever their type)
        self.tensor_types: dict[str, str] = {}
        for name, (kind, layer, suffix) in self.kinds.items():
            if kind not in _DEQUANTIZED | _CONFIG_ONLY:
                for target in self._targets(kind, layer, suffix):
                    self.tensor_types[target] = self.tensors[name].tensor_type.name
        expert_types = {self.tensors[n].tensor_type.name for n, (kind, _, _) in
                        self.kinds.items() if kind in _EXPERTS} - FLOAT_TYPES
        if expert_types:
            logger.info("GGUF expert weights (%s) are dequantized at load: the MoE layer "
                        "has no quantized GGUF method yet", ", ".join(sorted(expert_types)))

    def _field(self, key: str, default=None):
        field_ = self.reader.fields.get(key)
        return default if field_ is None else field_.contents()

    def hparam(self, key: str, default=None):
        """A hyperparameter under this file's architecture ("attention.head_count")."""
        return self._field(f"{self.arch}.{key}", default)

    @property
    def head_dim(self) -> int:
        return self.hparam("attention.key_length",
                        self.hparam("embedding_length") // self.hparam("attention.head_count"))

    def config(self):
        from transformers import AutoConfig
        heads, head_dim = self.hparam("attention.head_count"), self.head_dim
        kwargs = dict(
            architectures=[self.spec.architecture],
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),
            hidden_size=self.hparam("embedding_length"),
            intermediate_size=self.hparam("feed_forward_length"),
            num_hidden_layers=self.hparam("block_count"), num_attention_heads=heads,
            num_key_value_heads=self.hparam("attention.head_count_kv", heads),
            head_dim=head_dim, max_position_embeddings=self.hparam("context_length", 4096),
            rms_norm_eps=self.hparam("attention.layer_norm_rms_epsilon", 1e-6),
            rope_parameters=self.rope_parameters(head_dim),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self._field("tokenizer.ggml.padding_token_id"),
            quantization_config={"quant_method": "gguf", "tensor_types": self.tensor_types},
        )
        kwargs.update(self.spec.extra_config(self))
        return AutoConfig.for_model(self.spec.model_type, **kwargs)

    def rope_parameters(self, head_dim: int) -> dict:
        """HF rope_parameters from the rope keys: base, rotary dims, linear / YaRN scaling,
        Phi-3's longrope factor tensors. llama3-style frequency factors (`rope_freqs`) are
        refused: HF's four llama3 parameters cannot be recovered from them."""
        params = {"rope_type": "default",
                  "rope_theta": float(self.hparam("rope.freq_base", 10000.0))}
        rotary_dims = self.hparam("rope.dimension_count")
        if rotary_dims and rotary_dims != head_dim:
            params["partial_rotary_factor"] = rotary_dims / head_dim
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{self.path}: GGUF rope frequency factors (rope_freqs, "
                                  "llama3-style rope scaling) are not supported")
        kind = self.hparam("rope.scaling.type", "none")
        factor = self.hparam("rope.scaling.factor")
        original = self.hparam("rope.scaling.original_context_length")
        if "rope_factors_long.weight" in self.tensors:
            params.update(rope_type="longrope", long_factor=self._floats("rope_factors_long"),
                          short_factor=self._floats("rope_factors_short"),
                          original_max_position_embeddings=original)
            if self.hparam("rope.scaling.attn_factor") is not None:
                params["attention_factor"] = float(self.hparam("rope.scaling.attn_factor"))
        elif kind == "linear":
            params.update(rope_type="linear", factor=float(factor))
        elif kind == "yarn":
            params.update(rope_type="yarn", factor=float(factor),
                          original_max_position_embeddings=int(original))
            for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                ("yarn_attn_factor", "attention_factor")):
                if self.hparam(f"rope.scaling.{key}") is not None:
                    params[hf_key] = float(self.hparam(f"rope.scaling.{key}"))
        elif kind != "none":
            raise CheckpointError(f"{self.path}: GGUF rope scaling {kind!r} is not supported")
        return params

    def _floats(self, tensor_name: str) -> list[float]:
        return [float(v) for v in self._dequantized(self.tensors[f"{tensor_name}.weight"])]

    @property
    def num_weight_tensors(self) -> int:
        """The file's tensors that hold weights (not those only the config reads)."""
        return sum(kind not in _CONFIG_ONLY for kind, _, _ in self.kinds.values())

    def weights(self, config, on_tensor: Callable[[], object] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every weight: blocks where GgufConfig keeps them, float32
        otherwise; fused tensors cut into their parts, experts one at a time. `on_tensor`
        is called after each of the file's tensors (a progress bar's update)."""
        kept = GgufConfig(self.tensor_types)
        for name, tensor in self.tensors.items():
            kind, layer, suffix = self.kinds[name]
            if kind in _CONFIG_ONLY:
                continue
            targets = self._targets(kind, layer, suffix)
            if kind not in _DEQUANTIZED and kept.keeps_blocks(targets[0]):
                weight = self._blocks(tensor)
            else:
                weight = self._dequantized(tensor)
            weight = self._convert(kind, suffix, weight, config)
            yield from self._split(kind, targets, weight, config)
            if on_tensor is not None:
                on_tensor()

    @staticmethod
    def _blocks(tensor) -> torch.Tensor:
        import gguf
        _, nbytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        rows = tensor.data.shape[0]
        return torch.from_numpy(np.array(tensor.data).reshape(rows, -1, nbytes))

    @staticmethod
    def _dequantized(tensor) -> torch.Tensor:
        from gguf.quants import dequantize
        array = dequantize(tensor.data, tensor.tensor_type)
        array = np.ascontiguousarray(array.reshape(tuple(reversed(tensor.shape.tolist()))))
        return torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy

    def _convert(self, kind: str, suffix: str, weight: torch.Tensor, config) -> torch.Tensor:
        """Undo llama.cpp's storage conventions (module docstring)."""
        if self.spec.permuted_qk and kind in ("ATTN_Q", "ATTN_K"):
            n_head = config.num_attention_heads if kind == "ATTN_Q" else \
                config.num_key_value_heads
            weight = unpermute_rows(weight, n_head)
        if self.spec.norm_offset and kind.endswith("NORM") and suffix == "weight":
            weight = weight - self.spec.norm_offset
        if kind == "FFN_GATE_INP_SHEXP":
            weight = weight.reshape(1, -1)  # a Linear(hidden, 1), stored flat
        return weight

    def _split(self, kind: str, targets: list[str], weight: torch.Tensor, config
               ) -> Iterator[tuple[str, torch.Tensor]]:
        if kind in _EXPERTS:
            for expert in range(weight.shape[0]):
                yield targets[0].format(expert=expert), weight[expert]
            return
        if len(targets) == 1:
            yield targets[0], weight
            return
        sizes = self._fused_rows(kind, config)
        if weight.shape[0] != sum(sizes):
            raise CheckpointError(f"{self.path}: fused GGUF tensor for {targets[0]} has "
                                  f"{weight.shape[0]} rows, expected {' + '.join(map(str, sizes))}")
        yield from zip(targets, weight.split(sizes, dim=0))

    @staticmethod
    def _fused_rows(kind: str, config) -> list[int]:
        if kind == "ATTN_QKV":
            head_dim = getattr(config, "head_dim", None) or \
                config.hidden_size // config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            return [config.num_attention_heads * head_dim] + [kv_heads * head_dim] * 2
        return [config.intermediate_size] * 2  # Phi-3's ffn_up: gate rows, then up rows

    def _parse(self, name: str) -> tuple[str, int | None, str]:
        """A tensor name -> (MODEL_TENSOR name, layer or None, "weight" | "bias")."""
        base, _, suffix = name.rpartition(".")
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        layer = int(match[1]) if match else None
        key = f"blk.{{bid}}.{match[2]}" if match else base
        kind = _tensor_kinds(self.arch).get(key)
        known = _HF_NAMES.keys() | self.spec.renames.keys() | _CONFIG_ONLY
        if kind is None or kind not in known or suffix not in ("weight", "bias"):
            raise CheckpointError(f"{self.path}: unexpected GGUF tensor {name!r} for "
                                  f"architecture {self.arch!r}")
        return kind, layer, suffix

    def _targets(self, kind: str, layer: int | None, suffix: str) -> list[str]:
        paths = self.spec.renames.get(kind) or _HF_NAMES.get(kind, ())
        prefix = "" if layer is None else f"layers.{layer}."
        return [f"{prefix}{path}.{suffix}" for path in paths]


@functools.cache
def _tensor_kinds(arch: str) -> dict[str, str]:
    """gguf's tensor name patterns of an architecture ("blk.{bid}.attn_q") -> their
    MODEL_TENSOR names (gguf.MODEL_TENSORS lists what llama.cpp loads for it)."""
    import gguf
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return {gguf.TENSOR_NAMES[kind]: kind.name for kind in gguf.MODEL_TENSORS[model_arch]}


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of the rotary halves in attn_q / attn_k rows."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def load_tokenizer(path: Path) -> Tokenizer:
    """The file's tokenizer, which transformers builds from the metadata. For architectures
    its GGUF reader does not know (OLMo 2, GPT-NeoX) it is given the model type instead."""
    from tllm.loader.tokenizer_cache import cached_tokenizer

    def build() -> Tokenizer:
        from transformers.integrations.gguf import read_gguf_metadata
        metadata, _ = read_gguf_metadata(str(path), ())  # the keys only: fast
        spec = _SPECS.get(metadata.get("general.architecture"))
        return Tokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                         tokenizer_type=spec.tokenizer_type if spec else None)
    return cached_tokenizer(path, build)


# ---- per-architecture config keys ----

def _layer_types(checkpoint: GGUFCheckpoint, default_pattern: int) -> list[str]:
    """Sliding or full attention per layer: `attention.sliding_window_pattern` (a period, or
    a flag per layer), else llama.cpp's fixed period (every `default_pattern`-th global)."""
    count = checkpoint.hparam("block_count")
    pattern = checkpoint.hparam("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern > 1 and (i + 1) % pattern != 0 for i in range(count)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma(checkpoint: GGUFCheckpoint, large_layers: int, default_pattern: int,
           default_window: int | None, default_final_cap: float | None) -> dict:
    hidden, heads = checkpoint.hparam("embedding_length"), checkpoint.hparam("attention.head_count")
    head_dim = checkpoint.head_dim
    scale = checkpoint.hparam("attention.scale")
    if scale is not None:
        scalar = 1.0 / float(scale) ** 2
    else:  # llama.cpp: hidden / heads for the 27B model, else head_dim
        scalar = hidden // heads if checkpoint.hparam("block_count") == large_layers else head_dim
    window = checkpoint.hparam("attention.sliding_window", default_window)
    return dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                sliding_window=window,
                layer_types=_layer_types(checkpoint, default_pattern if window else 1),
                final_logit_softcapping=checkpoint.hparam("final_logit_softcapping",
                                                       default_final_cap))


def _gemma2(checkpoint: GGUFCheckpoint) -> dict:
    # the defaults: llama.cpp's (and HF's) when a file lacks the keys
    return dict(_gemma(checkpoint, large_layers=46, default_pattern=2, default_window=4096,
                       default_final_cap=30.0),
                attn_logit_softcapping=checkpoint.hparam("attn_logit_softcapping", 50.0))


def _gemma3(checkpoint: GGUFCheckpoint) -> dict:
    extra = _gemma(checkpoint, large_layers=62, default_pattern=6, default_window=None,
                   default_final_cap=None)
    local = {"rope_type": "default",
             "rope_theta": float(checkpoint.hparam("rope.freq_base_swa", 10000.0))}
    extra["rope_parameters"] = {"full_attention": checkpoint.rope_parameters(checkpoint.head_dim),
                                "sliding_attention": local}
    return dict(extra, attn_logit_softcapping=None)


def _phi3(checkpoint: GGUFCheckpoint) -> dict:
    window = checkpoint.hparam("attention.sliding_window") or None  # 0: none (Phi-4)
    return dict(sliding_window=window, original_max_position_embeddings=checkpoint.hparam(
        "rope.scaling.original_context_length", checkpoint.hparam("context_length")))


def _gpt_neox(checkpoint: GGUFCheckpoint) -> dict:
    return dict(layer_norm_eps=checkpoint.hparam("attention.layer_norm_epsilon", 1e-5),
                use_parallel_residual=bool(checkpoint.hparam("use_parallel_residual", True)),
                hidden_act="gelu", attention_bias=True)


def _experts(checkpoint: GGUFCheckpoint, renormalize: bool) -> dict:
    """Expert counts and sizes; the layers without a router are dense (`mlp_only_layers`)."""
    routed = {layer for kind, layer, _ in checkpoint.kinds.values() if kind == "FFN_GATE_INP"}
    dense = [i for i in range(checkpoint.hparam("block_count")) if i not in routed]
    return dict(num_experts=checkpoint.hparam("expert_count"),
                num_experts_per_tok=checkpoint.hparam("expert_used_count"),
                moe_intermediate_size=checkpoint.hparam("expert_feed_forward_length"),
                norm_topk_prob=bool(checkpoint.hparam("expert_weights_norm", renormalize)),
                mlp_only_layers=dense, decoder_sparse_step=1)


def _qwen2_moe(checkpoint: GGUFCheckpoint) -> dict:
    shared = checkpoint.hparam("expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_up_shexp.weight" in checkpoint.tensors:
        shared = int(checkpoint.tensors["blk.0.ffn_up_shexp.weight"].shape[1])
    return dict(_experts(checkpoint, renormalize=False),
                shared_expert_intermediate_size=shared)


def _mixtral(checkpoint: GGUFCheckpoint) -> dict:
    if checkpoint.hparam("expert_weights_norm", True) is False:
        raise CheckpointError(f"{checkpoint.path}: Mixtral experts without renormalised "
                              "top-k weights are not supported")
    return dict(num_local_experts=checkpoint.hparam("expert_count"),
                num_experts_per_tok=checkpoint.hparam("expert_used_count"), sliding_window=None)


_SPECS = {
    "llama": GgufArch("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": GgufArch("Qwen2MoeForCausalLM", "qwen2_moe", _qwen2_moe),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", "qwen3_moe",
                         lambda checkpoint: _experts(checkpoint, renormalize=True)),
    "gemma2": GgufArch("Gemma2ForCausalLM", "gemma2", _gemma2, norm_offset=1.0),
    "gemma3": GgufArch("Gemma3ForCausalLM", "gemma3_text", _gemma3, norm_offset=1.0),
    "phi3": GgufArch("Phi3ForCausalLM", "phi3", _phi3,
                     {"FFN_UP": ("mlp.gate_proj", "mlp.up_proj")}),
    "olmo2": GgufArch("Olmo2ForCausalLM", "olmo2", tokenizer_type="olmo2"),
    "gptneox": GgufArch("GPTNeoXForCausalLM", "gpt_neox", _gpt_neox,
                        {"FFN_UP": ("mlp.dense_h_to_4h",), "FFN_DOWN": ("mlp.dense_4h_to_h",)},
                        tokenizer_type="gpt_neox"),
}
_MIXTRAL = GgufArch("MixtralForCausalLM", "mixtral", _mixtral, permuted_qk=True)


def architecture_spec(arch: str | None, expert_count: int = 0) -> GgufArch:
    """The mapping for a GGUF architecture (llama with experts: Mixtral); a clear
    CheckpointError for one tllm cannot read."""
    if arch not in _SPECS:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; tllm reads "
                              f"{', '.join(_SPECS)}")
    return _MIXTRAL if arch == "llama" and expert_count else _SPECS[arch]
