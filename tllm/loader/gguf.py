"""GGUF files through the `gguf` package: an HF config built from the metadata (with the GGML
type of every tensor as its `quantization_config`), and weights under HF names: the blocks of
those tensors a quantization method keeps (tllm.layers.quant.gguf, [rows, blocks, bytes]),
the rest dequantised to float32."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tllm.layers.quant.gguf import GgufConfig
from tllm.loader.hf import CheckpointError

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        import gguf
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # the reader raises many kinds on a damaged file
            raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self.arch = self._field("general.architecture")
        if self.arch not in _ARCHITECTURES:
            raise CheckpointError(f"GGUF architecture {self.arch!r} is not supported; tllm reads "
                                  f"{', '.join(_ARCHITECTURES)}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        # HF name -> GGML type name: what GgufConfig chooses each layer's form from (an
        # unexpected name is refused by weights())
        self.tensor_types = {}
        for name, tensor in self.tensors.items():
            with contextlib.suppress(CheckpointError):
                self.tensor_types[self._hf_name(name)] = tensor.tensor_type.name

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def config(self):
        from transformers import AutoConfig
        a = self.arch
        if self._field(f"{a}.rope.scaling.type") not in (None, "none") or \
                "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{self.path}: GGUF rope scaling is not supported yet")
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        kwargs = dict(
            architectures=[_ARCHITECTURES[a]],
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden, intermediate_size=self._field(f"{a}.feed_forward_length"),
            num_hidden_layers=self._field(f"{a}.block_count"), num_attention_heads=heads,
            num_key_value_heads=self._field(f"{a}.attention.head_count_kv", heads),
            head_dim=self._field(f"{a}.attention.key_length", hidden // heads),
            max_position_embeddings=self._field(f"{a}.context_length", 4096),
            rms_norm_eps=self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_parameters={"rope_type": "default",
                             "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0))},
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            quantization_config={"quant_method": "gguf", "tensor_types": self.tensor_types},
        )
        return AutoConfig.for_model(a, **kwargs)

    def weights(self, config) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize
        kept = GgufConfig(self.tensor_types)
        for name, tensor in self.tensors.items():
            hf_name = self._hf_name(name)
            if kept.keeps_blocks(hf_name):
                _, nbytes = gguf_block_shape(tensor.tensor_type)
                rows = tensor.data.shape[0]
                weight = torch.from_numpy(np.array(tensor.data).reshape(rows, -1, nbytes))
            else:
                array = dequantize(tensor.data, tensor.tensor_type)
                array = np.ascontiguousarray(
                    array.reshape(tuple(reversed(tensor.shape.tolist()))))
                weight = torch.from_numpy(np.array(array, dtype=np.float32))  # writable copy
            if self.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                n_head = (config.num_attention_heads if "attn_q" in name
                          else config.num_key_value_heads)
                weight = unpermute_rows(weight, n_head)
            yield hf_name, weight

    @staticmethod
    def _hf_name(name: str) -> str:
        base, _, kind = name.rpartition(".")
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if match and match.group(2) in _LAYER_NAMES:
            return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{kind}"
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
        raise CheckpointError(f"unexpected GGUF tensor {name!r}")


def gguf_block_shape(tensor_type) -> tuple[int, int]:
    import gguf
    return gguf.GGML_QUANT_SIZES[tensor_type]


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of the rotary halves in attn_q / attn_k rows."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
