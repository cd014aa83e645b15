"""Which pipeline serves a model: a diffusers folder's `_class_name` (model_index.json), or a
`dummy:` name. Entries are import paths, so choosing one imports only that model's code, and
detecting a visual model imports nothing heavy."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

DUMMY_PREFIX = "dummy:"
MODEL_INDEX = "model_index.json"

_PIPELINES: dict[str, str] = {}     # _class_name -> "module:Class"
_DUMMIES: dict[str, str] = {}       # "dummy:<preset>" -> _class_name


def register(class_name: str, target: str, dummies: tuple[str, ...] = ()) -> None:
    """Serve diffusers folders whose _class_name is class_name with the pipeline at target
    ("module:Class"), and each of `dummies` with random weights in a shape of that model."""
    _PIPELINES[class_name] = target
    for dummy in dummies:
        _DUMMIES[dummy] = class_name


# dummy:qwen-image-tiny: the same pipeline in tiny shapes, for a CPU (seconds an image).
register("QwenImagePipeline", "tllm.visual_gen.models.qwen_image.pipeline:QwenImagePipeline",
         dummies=("dummy:qwen-image", "dummy:qwen-image-tiny"))
register("QwenImageLayeredPipeline",
         "tllm.visual_gen.models.qwen_image.layered_pipeline:QwenImageLayeredPipeline",
         dummies=("dummy:qwen-image-layered",))
register("Cosmos3OmniPipeline", "tllm.visual_gen.models.cosmos3.pipeline:Cosmos3Pipeline",
         dummies=("dummy:cosmos",))
register("LTX2Pipeline", "tllm.visual_gen.models.ltx2.pipeline:LTX2Pipeline",
         dummies=("dummy:ltx2",))
register("FluxPipeline", "tllm.visual_gen.models.flux.pipeline:FluxPipeline",
         dummies=("dummy:flux.1-dev", "dummy:flux.1-schnell"))
register("WanPipeline", "tllm.visual_gen.models.wan.pipeline:WanPipeline",
         dummies=("dummy:wan2.2-ti2v-5b", "dummy:wan2.2-t2v-a14b"))
register("LTX2ImageToVideoPipeline",
         "tllm.visual_gen.models.ltx2.pipeline:LTX2ImageToVideoPipeline")


@dataclass(frozen=True)
class VisualModelSpec:
    """A resolved model argument: the pipeline class name, and a folder or a dummy preset."""

    class_name: str
    path: Path | None = None
    dummy_preset: str | None = None     # "qwen-image" for "dummy:qwen-image"

    def pipeline_class(self) -> type:
        module, _, name = _PIPELINES[self.class_name].partition(":")
        return getattr(importlib.import_module(module), name)


def resolve(model: str) -> VisualModelSpec:
    """The spec of a diffusers folder or a dummy name; ValueError for anything else."""
    if model.startswith(DUMMY_PREFIX):
        if model not in _DUMMIES:
            raise ValueError(f"model: unknown visual dummy model {model!r}; choose one of "
                             f"{', '.join(sorted(_DUMMIES))}")
        return VisualModelSpec(_DUMMIES[model], dummy_preset=model.removeprefix(DUMMY_PREFIX))
    path = Path(model).expanduser()
    index = path / MODEL_INDEX
    if not index.is_file():
        raise FileNotFoundError(f"model: {model!r} is not a diffusers model folder (no "
                                f"{MODEL_INDEX})")
    class_name = json.loads(index.read_text()).get("_class_name")
    if class_name not in _PIPELINES:
        raise ValueError(f"model: pipeline {class_name!r} of {model!r} is not supported; "
                         f"supported: {', '.join(sorted(_PIPELINES))}")
    return VisualModelSpec(class_name, path=path)


def is_visual_model(model: str | None) -> bool:
    """Whether `model` names a visual model (a dummy name or a folder with model_index.json)."""
    if not model:
        return False
    if model.startswith(DUMMY_PREFIX):
        return model in _DUMMIES
    return (Path(model).expanduser() / MODEL_INDEX).is_file()
