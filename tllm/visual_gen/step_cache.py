"""Step caching for the DiT transformers (a request's `cache="teacache" | "first_block"`):
a denoising step whose transformer input barely changed since the last step reuses the
residual the block stack added last time it ran, instead of running the blocks.

The change is measured as relative L1 distance, mean|a - b| / mean|b|, between this step's and
the previous step's signal, accumulated over skipped steps; while the sum stays under the
threshold the step is skipped, else the blocks run and the sum restarts at 0:

- "teacache": the signal is the first block's modulated input, known before any block runs
  (TeaCache); the distance goes through the model's published rescale polynomial when it has
  one (`BlockStack.coefficients`), else it is used as is; the residual is the whole stack's.
- "first_block": the first block always runs; the signal is its output residual (first-block
  cache), and the residual reused is that of the remaining blocks.

The first and the last step always run. A threshold of 0 never skips, and the steps that run
compute exactly what they compute without a cache. When the network running the blocks
changes within a loop (Wan 2.2 A14B's switch from the high-noise to the low-noise expert,
`BlockStack.network`), the cache starts over: the residual it holds is the other network's,
and the two networks' signals are not comparable, so the new network's first step runs.

How a transformer takes part (the interface): its forward builds a `BlockStack` over its own
state between blocks (any object: a tensor, a tuple of streams, pending residuals...) and
calls `run_blocks(stack, state, cache)` in place of its loop over the blocks; `cache` comes
from the pipeline's step (`step.model_kwargs["step_cache"]`, set by the StepCache hook).
A transformer that supports it sets `supports_step_cache = True`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tllm.visual_gen.pipeline import DenoiseHook, DenoiseStep

CACHE_MODES = ("teacache", "first_block")
DEFAULT_THRESHOLDS = {"teacache": 0.2, "first_block": 0.1}
MODEL_KWARG = "step_cache"


@dataclass
class BlockStack:
    """A transformer's block stack as the cache sees it, over the model's own `state`:

    first(state) -> state after the first block; rest(state) -> after the remaining blocks;
    modulated_input(state) -> the first block's modulated input (teacache's signal);
    hidden(state) -> the streams' hidden states as tensors (the first is the main one, whose
    first-block residual is first_block's signal); with_residuals(state, residuals) -> the
    state with each stream's hidden state advanced by its residual; coefficients: the
    published TeaCache rescale polynomial (highest power first) or None; network: the
    module whose blocks these are (a change starts the cache over)."""

    first: Callable[[Any], Any]
    rest: Callable[[Any], Any]
    modulated_input: Callable[[Any], torch.Tensor]
    hidden: Callable[[Any], list[torch.Tensor]]
    with_residuals: Callable[[Any, list[torch.Tensor]], Any]
    coefficients: Sequence[float] | None = None
    network: Any = None


def run_blocks(stack: BlockStack, state: Any, cache: StepCache | None) -> Any:
    """The state after every block: run, or (cache permitting) the cached residuals added."""
    if cache is None:
        return stack.rest(stack.first(state))
    return cache.run(stack, state)


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    previous = previous.float()
    change = (current.float() - previous).abs().mean() / previous.abs().mean()
    return float(change)


class StepCache(DenoiseHook):
    """One request's step cache. As a loop hook it hands itself to the transformer each
    step; its state resets when a loop ends, so one instance serves the loops of a request
    (one per video) and records each loop's skipped steps in `skipped_per_loop`."""

    def __init__(self, mode: str, threshold: float) -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {mode!r}")
        self.mode, self.threshold = mode, threshold
        self.skipped_per_loop: list[int] = []
        self._reset()

    def _reset(self) -> None:
        self.previous: torch.Tensor | None = None
        self.residuals: list[torch.Tensor] | None = None
        self.accumulated = 0.0
        self.skipped = 0
        self.step_index, self.num_steps = 0, 0
        self.decided_step: int | None = None
        self.network: Any = None

    # ---- the loop's side ----

    def prepare(self, step: DenoiseStep) -> None:
        self.step_index, self.num_steps = step.index, step.num_steps
        step.model_kwargs[MODEL_KWARG] = self

    def free(self) -> None:
        if self.num_steps:
            self.skipped_per_loop.append(self.skipped)
        self._reset()

    # ---- the transformer's side ----

    def run(self, stack: BlockStack, state: Any) -> Any:
        if self.decided_step == self.step_index:
            raise RuntimeError("step caching needs one transformer forward per step")
        self.decided_step = self.step_index
        if stack.network is not self.network:      # e.g. the next expert: start over
            self.network, self.previous, self.residuals = stack.network, None, None
        if self.mode == "teacache":
            if self._skips(stack.modulated_input(state), stack.coefficients):
                return stack.with_residuals(state, self.residuals)
            start = state
            state = stack.rest(stack.first(state))
        else:
            start = stack.first(state)
            residual = stack.hidden(start)[0] - stack.hidden(state)[0]
            if self._skips(residual, None):
                return stack.with_residuals(start, self.residuals)
            state = stack.rest(start)
        self.residuals = [end - begin for end, begin in zip(stack.hidden(state),
                                                            stack.hidden(start))]
        return state

    def _skips(self, signal: torch.Tensor, coefficients: Sequence[float] | None) -> bool:
        previous, self.previous = self.previous, signal
        edge = self.step_index in (0, self.num_steps - 1)
        if previous is None or edge or self.residuals is None or self.threshold <= 0:
            self.accumulated = 0.0
            return False
        change = relative_l1(signal, previous)
        if coefficients is not None:     # fitted polynomials can dip below 0 near 0
            change = max(0.0, sum(c * change ** p
                                  for p, c in enumerate(reversed(coefficients))))
        self.accumulated += change
        if self.accumulated < self.threshold:
            self.skipped += 1
            return True
        self.accumulated = 0.0
        return False


def check_supported(transformer, mode: str | None) -> None:
    """ValueError when a request asks for caching a transformer does not support."""
    if mode is not None and not getattr(transformer, "supports_step_cache", False):
        raise ValueError(f"VisualGenParams.cache {mode!r} needs our transformer "
                         f"(transformer_impl 'tllm'), not {type(transformer).__name__}")


def skipped_per_output(cache: StepCache, num_outputs: int) -> list[int]:
    """Steps skipped for each image or video of a request: one loop for all of them (an
    image batch), or one loop each (videos)."""
    loops = cache.skipped_per_loop
    if len(loops) == num_outputs:
        return list(loops)
    if len(loops) == 1:
        return loops * num_outputs
    return [sum(loops)] * num_outputs
