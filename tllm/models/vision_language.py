"""What the vision-language models with a `vision_tower` and a `multi_modal_projector`
(LLaVA, Gemma 3, Mistral 3, LLaVA-OneVision) share: the tower built from transformers, its
selected layer's patch features, and their checkpoints split into the tower's and projector's tensors (copied here) and the
decoder's (handed to the decoder's own loader)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from tllm.layers.linear import _copy_checked

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def build_vision_tower(config) -> nn.Module:
    """transformers' vision model for the composite config's vision config (SDPA: the
    tower runs once per image, eagerly)."""
    from transformers import AutoModel
    config.vision_config._attn_implementation = "sdpa"
    return AutoModel.from_config(config.vision_config)


def tower_features(tower: nn.Module, pixels: torch.Tensor, hf_config) -> torch.Tensor:
    """The patch features [images, patches, hidden] of the config's `vision_feature_layer`,
    without the CLS token's under the "default" `vision_feature_select_strategy`."""
    out = tower(pixels, output_hidden_states=True, return_dict=True)
    features = out.hidden_states[hf_config.vision_feature_layer]
    if hf_config.vision_feature_select_strategy == "default":
        features = features[:, 1:]
    return features


def load_vision_language_weights(
        model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
        load_text: Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]]) -> set[str]:
    """Checkpoint names of transformers 5 (model.vision_tower.*, model.multi_modal_projector.*,
    model.language_model.*, lm_head.*) or the older layout (vision_tower.*,
    multi_modal_projector.*, language_model.model.*, language_model.lm_head.*). The
    model's own parameters (not its modules': LLaVA-OneVision's image_newline) load here
    too."""
    params = {f"vision_tower.{n}": p for n, p in model.vision_tower.named_parameters()}
    params.update({f"multi_modal_projector.{n}": p
                   for n, p in model.multi_modal_projector.named_parameters()})
    params.update(model.named_parameters(recurse=False))
    loaded: set[str] = set()

    def text_weights():
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(VISION_PREFIXES) or name in params:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(model).__name__}")
                _copy_checked(params[name], tensor, name)
                loaded.add(f"{name}#None")
                continue
            yield name.removeprefix("language_model.").removeprefix("model."), tensor

    text_loaded = load_text(text_weights())
    return loaded | text_loaded
