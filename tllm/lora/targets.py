"""LoraTargets: what an engine's LoRA layers accept, as plain data (no torch: it crosses to
the server's process, which checks an adapter against it when a client registers one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tllm.lora.adapter import Adapter


@dataclass(frozen=True)
class LoraTargets:
    """Each projection's (in_features, out_features) over all tensor-parallel ranks by
    checkpoint module name, the largest rank, and the decoder layers held by other pipeline
    stages (their projections are checked by name only here, by their stage when loaded)."""

    shapes: dict[str, tuple[int, int]]
    max_rank: int
    other_stage_layers: frozenset[int] = frozenset()

    def check(self, adapter: Adapter) -> None:
        """ValueError naming the first module the model lacks or whose shapes do not fit."""
        name = adapter.request.lora_name
        for module, weights in adapter.modules.items():
            shape = self.shapes.get(module)
            if shape is None:
                if self._on_other_stage(module):
                    continue
                raise ValueError(f"lora_request {name!r}: the model has no projection "
                                 f"{module!r} to adapt")
            (num_in, num_out), rank = shape, weights.rank
            want_a, want_b = (rank, num_in), (num_out, rank)
            have_a, have_b = tuple(weights.a.shape), tuple(weights.b.shape)
            if have_a != want_a or have_b != want_b:
                raise ValueError(f"lora_request {name!r}: {module} has lora_A {have_a} and "
                                 f"lora_B {have_b}; the model needs {want_a} and {want_b} "
                                 f"(in_features {num_in}, out_features {num_out})")

    def _on_other_stage(self, module: str) -> bool:
        parts = module.split(".")
        return (len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit()
                and int(parts[1]) in self.other_stage_layers)
