"""KV cache groups: how a model whose layers attend differently (full attention, sliding
windows) shares one pool of blocks (vLLM v1's hybrid KV cache, simplified).

Layers of one kind (full attention, or one window size) form groups of equal size: each kind
is cut into groups of as many layers as the rarest kind has (Gemma 2, alternating: one full
group and one window group; Gemma 3 with 5 window layers to 1 global: groups of the global
layers' count). The cache holds `num_slots` (key, value) tensor pairs; a block id names one
block in each of them, and layer j of group g stores its keys in slot j under group g's block
ids. A request has one block table per group, so a window group can drop the blocks its window
has passed while the full group keeps them all."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None          # keys within the last `window` positions; None: all of them
    layers: tuple[int, ...]     # model-wide layer indices


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups of a model and where this rank's layers keep their keys and values."""

    groups: tuple[KVCacheGroup, ...]
    layer_slots: tuple[int, ...]    # this rank's n-th layer -> its slot (tensor pair)
    num_slots: int
    layer_groups: tuple[int, ...]   # model-wide layer -> its group; empty with one group

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> list[int | None]:
        return [group.window for group in self.groups]


def plan_layout(num_local_layers: int, layer_windows: tuple[int | None, ...] = (),
                first_layer: int = 0) -> KVCacheLayout:
    """Groups from every model layer's window (`layer_windows`, all pipeline stages, so that
    every rank forms the same groups; empty: every layer full), and slots for the
    `num_local_layers` layers from `first_layer` on that this rank holds."""
    if num_local_layers < 1:
        raise ValueError(f"num_layers must be positive, got {num_local_layers}")
    local = range(first_layer, first_layer + num_local_layers)
    windows = tuple(layer_windows) or (None,) * (first_layer + num_local_layers)
    if len(windows) < local.stop:
        raise ValueError(f"layer_windows: {len(windows)} entries for layers up to "
                         f"{local.stop - 1}")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"layer_windows: a sliding window must be positive, got {windows}")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in sorted(enumerate(windows), key=lambda lw: lw[1] is not None):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:  # one kind: one group, exactly the plain cache
        [(window, _)] = kinds.items()
        return KVCacheLayout((KVCacheGroup(window, tuple(range(len(windows)))),),
                             tuple(range(num_local_layers)), num_local_layers, ())
    size = min(len(layers) for layers in kinds.values())
    groups = tuple(KVCacheGroup(window, tuple(layers[i:i + size]))
                   for window, layers in kinds.items() for i in range(0, len(layers), size))
    layer_groups = [0] * len(windows)
    slot_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for layer in group.layers:
            layer_groups[layer] = g
        for slot, layer in enumerate(l for l in group.layers if l in local):
            slot_of[layer] = slot
    slots = tuple(slot_of[layer] for layer in local)
    return KVCacheLayout(groups, slots, max(slots) + 1, tuple(layer_groups))


def window_peak_blocks(window: int, max_step_tokens: int, tokens_per_block: int) -> int:
    """The most blocks a window group holds during a step of up to `max_step_tokens`
    tokens: those the window reaches back to from the step's first token, and the step's."""
    return -(-(max_step_tokens + window - 1) // tokens_per_block) + 1


def first_live_block(window: int | None, num_computed: int, tokens_per_block: int) -> int:
    """The first block a group still needs once `num_computed` tokens are computed: the next
    query (at position num_computed) sees keys from num_computed - window + 1 on."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // tokens_per_block
