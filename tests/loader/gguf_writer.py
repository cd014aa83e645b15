"""A test's stand-in for llama.cpp's convert_hf_to_gguf.py: an HF model written as a GGUF file
with that converter's conventions, tensor names from gguf's own tables (TensorNameMap), F32 or
one quantized type for the matrices, and a minimal sentencepiece-style vocabulary (the loader
builds the tokenizer from it; the tests pass token ids).

The conventions (one function per architecture that has any): llama and Mixtral interleave
q/k rows for ggml's rotary; MoE experts stacked per projection [E, rows, cols]; Gemma norms
stored as 1 + w; GPT-NeoX q/k/v rows regrouped from per-head to per-projection; Qwen2-MoE's
shared-expert gate stored flat."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

N_SPECIAL = 3  # <unk>, <s>, </s>


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's interleave of the rotary halves (LlamaModel.permute)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _llama(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith("q_proj.weight"):
        return permute_rows(tensor, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return permute_rows(tensor, config.num_key_value_heads)
    return tensor


def _gemma(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor + 1 if name.endswith("norm.weight") else tensor


def _gpt_neox(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if ".query_key_value." not in name:
        return tensor
    heads = config.num_attention_heads
    per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])   # each head's q, k, v
    return torch.cat([per_head[:, i].flatten(0, 1) for i in range(3)])


def _qwen2_moe(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    # the shared expert's gate [1, H] is stored flat, as real Qwen2-MoE files have it
    return tensor.flatten() if name.endswith("shared_expert_gate.weight") else tensor


CONVENTIONS = {"llama": _llama, "gemma2": _gemma, "gemma3": _gemma, "gptneox": _gpt_neox,
               "qwen2moe": _qwen2_moe}


def _tensors(model, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors after the converter's conventions; transformers 5's stacked gate_up
    experts [E, 2I, H] cut into the gate and up stacks llama.cpp stores."""
    convention = CONVENTIONS.get(arch, lambda config, name, tensor: tensor)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensor = convention(model.config, name, tensor.detach().float())
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
        else:
            yield name, tensor


def _encoded(gguf, gguf_name: str, tensor: torch.Tensor, qtype: str):
    """(data, GGML type or None for float32): float32 for vectors, norms and routers (as
    the converter keeps them), else `qtype`."""
    array = tensor.numpy().astype(np.float32)
    keep_float = (array.ndim < 2 or gguf_name.endswith("_norm.weight")
                  or ".ffn_gate_inp" in gguf_name or qtype == "F32")
    if keep_float:
        return array, None
    kind = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(array, kind), kind


def _rope(config) -> dict:
    params = config.rope_parameters or {}
    return params.get("full_attention", params)


def _common_metadata(writer, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None)
                             or config.num_attention_heads)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(_rope(config).get("rope_theta", 10000.0))
    if _rope(config).get("rope_type") == "linear":
        import gguf
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(_rope(config)["factor"])
    if getattr(config, "rms_norm_eps", None):
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _gemma_metadata(writer, config) -> None:
    writer.add_sliding_window(config.sliding_window)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    else:
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])


def _phi3_metadata(writer, config) -> None:
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        original = config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight",
                          np.array(rope["short_factor"], np.float32))


def _neox_metadata(writer, config) -> None:
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(config.rope_parameters["partial_rotary_factor"]
                                        * head_dim))
    writer.add_parallel_residual(config.use_parallel_residual)
    writer.add_layer_norm_eps(config.layer_norm_eps)


ARCH_METADATA = {"gemma2": _gemma_metadata, "gemma3": _gemma_metadata,
                 "phi3": _phi3_metadata, "gptneox": _neox_metadata}


def _vocabulary(writer, config) -> None:
    n = config.vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(N_SPECIAL, n)])
    writer.add_token_scores([0.0] * n)
    writer.add_token_types([2, 3, 3] + [1] * (n - N_SPECIAL))  # unknown, control, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(model, path: Path, arch: str, qtype: str = "F32") -> Path:
    """Write `model` (an HF causal LM) to `path` as GGUF architecture `arch`."""
    import gguf
    config = model.config
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _common_metadata(writer, config)
    ARCH_METADATA.get(arch, lambda w, c: None)(writer, config)
    _vocabulary(writer, config)
    for name, tensor in _tensors(model, arch):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{name} has no GGUF name in gguf's {arch} table")
        if not gguf_name.endswith((".weight", ".bias")):
            gguf_name += ".weight"  # transformers 5's stacked experts carry no suffix
        data, kind = _encoded(gguf, gguf_name, tensor, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
