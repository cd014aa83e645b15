"""The visual-generation API: `VisualGen(model).generate(prompt, params)`."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from tllm.device import pick_device
from tllm.extras import require_extra
from tllm.visual_gen import batching, memory, registry
from tllm.visual_gen.fp8 import check_quantization, quantize_pipeline
from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.pipeline import DenoiseHook, VisualGenOutput
from tllm.visual_gen.step_cache import (DEFAULT_THRESHOLDS, StepCache, check_supported,
                                        skipped_per_output)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class VisualGen:
    """An image-generation model, e.g. `VisualGen("dummy:qwen-image")` or
    `VisualGen("/path/to/Qwen-Image")` (a diffusers-format folder).

    dtype "auto" is bfloat16 on a GPU and float32 on the CPU. transformer_impl picks the
    transformer: "tllm" (ours), "diffusers" (the reference) or "auto" (ours when available).
    `seed` seeds the random weights of dummy models. Before allocating anything, the weights'
    size is checked against the device's free memory (memory.py): ModelTooLargeError (a
    ValueError) when they do not fit, unless check_memory=False. quantization "fp8" stores
    the linear layers of the transformer's blocks in FP8 (fp8.py).
    """

    def __init__(self, model: str, dtype: str = "auto", device: str | None = None,
                 transformer_impl: str = "auto", seed: int = 0,
                 show_progress: bool = True, check_memory: bool = True,
                 quantization: str | None = None) -> None:
        require_extra("visual", "visual generation")
        check_quantization(quantization, transformer_impl)
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got "
                             f"{dtype!r}")
        spec = registry.resolve(model)
        self.model = model
        self.device = pick_device(device)
        self.dtype = _DTYPES.get(dtype) or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if check_memory:
            memory.check_fits(model, memory.estimate_weight_bytes(spec, self.dtype),
                              self.device)
        pipeline_cls = spec.pipeline_class()
        if spec.dummy_preset is not None:
            self.pipeline = pipeline_cls.from_dummy(spec.dummy_preset, self.dtype, self.device,
                                                    seed, transformer_impl)
        else:
            self.pipeline = pipeline_cls.from_pretrained(spec.path, self.dtype, self.device,
                                                         transformer_impl)
        if quantization == "fp8":
            quantize_pipeline(self.pipeline)
        self.pipeline.show_progress = show_progress

    @property
    def takes_image(self) -> bool:
        """Whether the model works on an input image (the layered model)."""
        return self.pipeline.takes_image

    @property
    def makes_video(self) -> bool:
        """Whether the model generates videos (VisualGenOutput.videos)."""
        return getattr(self.pipeline, "makes_video", False)

    def check_request(self, prompt: str | Sequence[str], params: VisualGenParams,
                      image: Any | Sequence[Any] | None = None) -> None:
        """Raise the ValueError generate() would raise for these arguments, without
        generating (servers validate before they queue)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        images = None if image is None else (
            list(image) if isinstance(image, (list, tuple)) else [image])
        self.pipeline.check_request(params, images, prompts)
        check_supported(self.pipeline.transformer, params.cache)

    def frames_for_duration(self, seconds: float, frame_rate: float | None) -> int:
        """The number of frames this video model makes for about `seconds` of video."""
        return self.pipeline.frames_for_duration(seconds, frame_rate)

    def generate(self, prompt: str | Sequence[str], params: VisualGenParams | None = None,
                 image: Any | Sequence[Any] | None = None,
                 hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        """Images for one prompt or a batch of prompts (num_images_per_prompt each);
        `image` is the input of models that take one (one for all prompts, or one each)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        images = None if image is None else (
            list(image) if isinstance(image, (list, tuple)) else [image])
        params = params or VisualGenParams()
        if params.cache is None:
            return self.pipeline.generate(prompts, params, images, hooks)
        check_supported(self.pipeline.transformer, params.cache)
        threshold = params.cache_threshold
        cache = StepCache(params.cache, DEFAULT_THRESHOLDS[params.cache] if threshold is None
                          else threshold)
        out = self.pipeline.generate(prompts, params, images, [*hooks, cache])
        out.steps_skipped = skipped_per_output(cache, len(out.seeds))
        return out

    @property
    def can_batch(self) -> bool:
        """Whether generate_batch() can run several requests as one transformer batch."""
        return batching.can_batch(self.pipeline)

    def generate_batch(self, requests: Sequence[batching.ImageRequest],
                       hooks: Sequence[DenoiseHook] = ()) -> list[VisualGenOutput | Exception]:
        """Several requests (same batching.batch_key) as one transformer batch, each image
        as its request alone makes it: each request's output, or the exception that failed
        it before the batch ran (its prompt or parameters)."""
        if not self.can_batch:
            raise ValueError(f"model: {self.model!r} does not batch requests")
        return batching.generate_batch(self.pipeline, requests, hooks)
