"""MTP drafting (MTPDecodingConfig): DeepSeek-V3's next-token-prediction module, read from the
target's own checkpoint (tllm.models.deepseek.mtp), drafts from the target's final hidden
states. It has an EAGLE-3 head's interface, so the EAGLE-3 drafter runs it: draft 1 from the
target's state, each further draft from the module's own state of the step before."""
from __future__ import annotations

import torch

from tllm.layers.linear import process_loaded_weights
from tllm.loader import _default_dtype, hf
from tllm.loader.dummy import init_dummy_weights
from tllm.loader.hf import CheckpointError
from tllm.models.deepseek.mtp import DeepseekMTPHead
from tllm.speculative.draft_model import draft_kv_cache
from tllm.speculative.eagle3 import Eagle3Drafter
from tllm.speculative.head_graphs import build_head_graphs


def _layer_tensors(files, prefix: str, device: str):
    """The checkpoint tensors whose names start with `prefix` (others are not read)."""
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def load_mtp_head(target_parts) -> DeepseekMTPHead:
    """The target checkpoint's first MTP module, in the target's dtype and device (random
    weights for a dummy: target)."""
    config, model = target_parts.config, target_parts.model
    if type(model).__name__ != "DeepseekV3ForCausalLM":
        raise ValueError(f"speculative_config: MTP drafts with DeepSeek-V3's next-token "
                         f"module; {type(model).__name__} has none")
    # built as the target is (loader.build_model): in its default dtype, so that what is
    # float32 whatever the dtype (the router's weight and bias) stays float32
    with torch.device(target_parts.device), _default_dtype(target_parts.dtype):
        head = DeepseekMTPHead(config, model, target_parts.max_seq_len + 64).eval()
    source = target_parts.source
    if source.kind == "dummy":
        init_dummy_weights(head)
    else:
        prefix = f"model.layers.{config.num_hidden_layers}."
        loaded = head.load_weights(_layer_tensors(hf.safetensors_files(source.path), prefix,
                                                  str(target_parts.device)))
        missing = head.missing_weights(loaded)
        if missing:
            raise CheckpointError(f"{source.path}: no MTP module ({prefix}*) for "
                                  f"speculative decoding; missing e.g. {missing[:3]}")
    process_loaded_weights(head)
    head.share_target(model)
    return head


def build_drafter(config, target_parts) -> Eagle3Drafter:
    """The drafter of an MTPDecodingConfig, next to the target's RankParts."""
    head = load_mtp_head(target_parts)
    kv = draft_kv_cache(head, target_parts.kv_cache, target_parts.device, target_parts.dtype)
    last_layer = target_parts.config.num_hidden_layers - 1
    drafter = Eagle3Drafter(head, kv, config.max_draft_len, (last_layer,),
                            target_parts.config.vocab_size, target_parts.device)
    drafter.graphs = build_head_graphs(head, kv, target_parts, config.max_draft_len,
                                       target_parts.config.hidden_size)
    return drafter
