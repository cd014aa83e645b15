"""DeepSeek-V3's multi-token-prediction (MTP) module as a draft head: checkpoint layer
`layers.<num_hidden_layers>` holds `enorm`, `hnorm`, `eh_proj`, a full decoder layer (MLA and
MoE) and `shared_head.{norm, head}`; it shares the target's embedding.

Position p reads the token after p and a hidden state of p: the target's final (normed)
hidden state, or for a chain of drafts the module's own pre-norm output of the position
before, as vLLM and SGLang run it:
h = eh_proj([enorm(embed(token)); hnorm(state)]), then the decoder layer, then
shared_head.norm and the head. It fits the EAGLE-3 drafter's head interface (`fuse`,
forward -> (normed, pre-norm), `compute_logits`, `to_target_ids`), so that drafter runs it
(tllm.speculative.mtp)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata, KVCache, KVCacheSpec
from tllm.layers.linear import Linear, _copy_checked
from tllm.layers.norm import RMSNorm
from tllm.layers.rotary import rotary_embedding
from tllm.models.deepseek.model import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from tllm.models.mixtral import EXPERT_PROJECTIONS, STACKED_PROJECTIONS, _EXPERT_TENSOR

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def _merged_name(name: str) -> tuple[str, int | None]:
    """An MLP's gate_proj / up_proj -> its merged gate_up_proj and shard."""
    for ckpt, (merged, shard) in DeepseekV3ForCausalLM.stacked_params.items():
        if f".{ckpt}." in f".{name}":
            return name.replace(ckpt, merged), shard
    return name, None


class DeepseekMTPHead(nn.Module):
    """The MTP module of checkpoint layer `layer` (the first: num_hidden_layers)."""

    def __init__(self, config, target: DeepseekV3ForCausalLM, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.layer = config.num_hidden_layers
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        rotary = rotary_embedding(config, config.qk_rope_head_dim, max_position)
        # the layer's sparse or dense MLP by its index, as the checkpoint has it
        self.block = DeepseekV3DecoderLayer(config, rotary, None, None,
                                            f"layers.{self.layer}")
        attn = self.block.self_attn
        attn.attn = target.make_attention_backend(None, attn,
                                                  target.attention_options(0))
        self.shared_head_norm = RMSNorm(hidden, eps)
        self.shared_head = Linear(hidden, config.vocab_size)
        self.target_norm = self.embed_tokens = None  # the target's (share_target)
        self.kv_cache_spec = KVCacheSpec(1, 1, config.kv_lora_rank + config.qk_rope_head_dim,
                                         keys_only=True)

    def share_target(self, target: DeepseekV3ForCausalLM) -> None:
        """Use the target's embedding and final norm (after this module's own weights are
        loaded and processed, so those stay untouched)."""
        self.embed_tokens, self.target_norm = target.embed_tokens, target.norm

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's last-layer states (residual added) -> its final normed states."""
        return self.target_norm(target_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata):
        x = torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)), dim=-1)
        out, residual = self.block(self.eh_proj(x), None, kv_caches[0], metadata)
        prenorm = out + residual
        return self.shared_head_norm(prenorm), prenorm

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.shared_head(normed)

    predicts_target_vocabulary = True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's vocabulary

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.layers.<layer>.*` tensors (others are skipped)."""
        prefix = f"layers.{self.layer}."
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if not self.takes_checkpoint_weight(name):
                continue
            name = name.removeprefix("model.")
            loaded.add(self._load_one(name.removeprefix(prefix), name, tensor, params))
        return loaded

    def takes_checkpoint_weight(self, name: str) -> bool:
        """A tensor of this module's layer, other than the (shared) embedding."""
        name = name.removeprefix("model.")
        return (name.startswith(f"layers.{self.layer}.")
                and not name.endswith("embed_tokens.weight"))

    def missing_weights(self, loaded: set[str]) -> list[str]:
        """Its own parameters (not the shared embedding and norm) no tensor was loaded
        into; experts count as loaded with any of theirs."""
        names = {k.split("#")[0] for k in loaded}
        return sorted(n for n, _ in self.named_parameters()
                      if not n.startswith("block.mlp.experts.")
                      and n not in names)

    def _load_one(self, rest: str, name: str, tensor: torch.Tensor, params) -> str:
        if rest.startswith(_OWN):
            target = rest.replace("shared_head.norm", "shared_head_norm").replace(
                "shared_head.head", "shared_head")
        else:
            match = _EXPERT_TENSOR.fullmatch(f"layers.0.{rest}")
            if match is not None:
                return self._load_expert(match, tensor)
            target, shard = _merged_name(rest)
            target = f"block.{target}"
            if shard is not None:
                module = self.get_submodule(target.rsplit(".", 1)[0])
                module.load_shard(target.rsplit(".", 1)[1], shard, tensor)
                return f"{target}#{shard}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the MTP module")
        _copy_checked(params[target], tensor, name)
        return f"{target}#None"

    def _load_expert(self, match, tensor: torch.Tensor) -> str:
        experts = self.block.mlp.experts
        if match[4]:
            keys = experts.load_stacked(STACKED_PROJECTIONS[match[4]], tensor)
        else:
            param, shard = EXPERT_PROJECTIONS[match[3]]
            keys = experts.load_expert(param, int(match[2]), shard, tensor)
        return ",".join(sorted(keys))
