"""Adapter slots as a resource (rank 0): `max_loras` slots of the stacked LoRA buffers, each
holding one adapter. A request takes a reference on its adapter's slot when the scheduler
admits it (`try_acquire`; loading the adapter into the least recently used free slot when it
is not in one) and gives it back when it ends or is preempted; a request whose adapter finds
no slot (every slot held by running requests of other adapters) stays waiting.

The loads are carried to every rank in the next step's plan (`take_loads`), applied in order
before that step's forward, so a tensor-parallel worker loads its own shard. Loads and steps
run in stream order: a slot is only reloaded once no running request uses it."""
from __future__ import annotations

from collections import OrderedDict

from tllm.lora.layers import LoraModel
from tllm.lora.request import LoRARequest
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager


class LoraManager(ResourceManager):
    """Slots of this engine's adapters, reference-counted by the requests that hold them."""

    def __init__(self, model: LoraModel) -> None:
        self.model = model
        self.max_loras = model.max_loras
        self._slot_ids: list[int | None] = [None] * self.max_loras   # adapter id per slot
        self._refs = [0] * self.max_loras
        self._idle: OrderedDict[int, None] = OrderedDict()  # loaded, unreferenced: LRU first
        self._held: dict[Request, int] = {}
        self._pending: dict[int, LoRARequest] = {}          # slot -> load for the next step
        self.num_loads = 0

    # ---- at submission ----

    def check(self, lora_request: LoRARequest) -> None:
        """ValueError if the adapter cannot be served (read, checked and cached here)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        self.model.adapter(lora_request)

    # ---- admission (the scheduler) ----

    def try_acquire(self, request: Request) -> bool:
        """A slot reference for the request's adapter; False: none free, it waits."""
        lora = request.lora_request
        if lora is None or request in self._held:
            return True
        slot = self._slot_of_id(lora.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._slot_ids[slot] = lora.lora_int_id
            self._pending[slot] = lora
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        self._held[request] = slot
        return True

    def release(self, request: Request) -> None:
        """The request no longer runs (finished, preempted or not admitted after all)."""
        slot = self._held.pop(request, None)
        if slot is None:
            return
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None

    def free(self, request: Request) -> None:
        self.release(request)

    def forget(self, lora_int_id: int) -> None:
        """An adapter unloaded by its user: its idle slot and cached tensors go."""
        self.model.forget(lora_int_id)
        slot = self._slot_of_id(lora_int_id)
        if slot is not None and self._refs[slot] == 0:
            self._idle.pop(slot, None)
            self._slot_ids[slot] = None

    # ---- the step (the model runner) ----

    def slot_of(self, request: Request) -> int:
        return self._held.get(request, -1)

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """The adapters to load into their slots before the next step runs."""
        loads = sorted(self._pending.items())
        self._pending.clear()
        return loads

    @property
    def num_active_slots(self) -> int:
        """Slots referenced by running requests (for tests and monitoring)."""
        return sum(1 for refs in self._refs if refs)

    def _slot_of_id(self, lora_int_id: int) -> int | None:
        for slot, held in enumerate(self._slot_ids):
            if held == lora_int_id:
                return slot
        return None

    def _free_slot(self) -> int | None:
        for slot, held in enumerate(self._slot_ids):
            if held is None:
                return slot
        if self._idle:
            slot, _ = self._idle.popitem(last=False)  # the least recently used
            return slot
        return None
