"""Visual generation (text-to-image diffusion): `VisualGen(model).generate(prompt, params)`.

Pipelines share one denoising loop (pipeline.py) and scheduler (schedulers.py); each model
family under models/ adds its prompt encoding, latent layout and decoding; registry.py picks
the pipeline from a diffusers folder's model_index.json or a `dummy:` name. Names are
imported on first use, so `import tllm.visual_gen.registry` stays cheap."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tllm.visual_gen.api import VisualGen
    from tllm.visual_gen.params import VisualGenParams
    from tllm.visual_gen.pipeline import VisualGenOutput

_EXPORTS = {"VisualGen": "tllm.visual_gen.api", "VisualGenParams": "tllm.visual_gen.params",
            "VisualGenOutput": "tllm.visual_gen.pipeline"}
__all__ = ["VisualGen", "VisualGenParams", "VisualGenOutput"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
