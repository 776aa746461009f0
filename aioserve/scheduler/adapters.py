"""The scheduler's LoRA bookkeeping: adapters by name, which slot holds
which, and what each step must load first.

An adapter is registered once its folder was read and checked (the engine's
`preload`, off the event loop); its id is never reused, so KV cached under
an earlier adapter of the same name is never matched (the id is the
prefix-cache namespace). A request takes a slot when it is admitted: its
adapter's, or a free one, or the least recently used one that no running
request holds (an eviction); with every slot held by running requests it
waits, as for pages. The load goes in the next plan, ahead of the step
that reads the slot, so every rank copies the same adapter at the same
point. Unloading takes the name away at once (new requests get a 404);
requests already holding the adapter finish on it, and its host copy goes
with the last of them.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aioserve.batch_plan import AdapterLoad
from aioserve.lora_config import AdapterError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Adapter:
    id: int
    name: str
    path: str
    requests: int = 0  # unfinished requests that run under it (waiting or running)
    unloaded: bool = False


class AdapterTable:
    def __init__(self, max_loras: int, forget: Callable[[int], None]) -> None:
        self.max_loras = max_loras
        self._forget = forget  # the engine lets an adapter's host copy go
        self.by_name: dict[str, Adapter] = {}
        self._ids = itertools.count(1)  # 0 is the base model's namespace
        # Slot -> the adapter it holds, least recently admitted first (slot 0, the base, is not here).
        self._slots: OrderedDict[int, Adapter] = OrderedDict()
        self._holders: dict[int, int] = {}  # slot -> running requests holding it
        self._loads: list[AdapterLoad] = []
        self._reload: set[int] = set()  # slots whose load failed: loaded again at the next admission
        self.evictions = 0

    # -- names -----------------------------------------------------------------

    def new_id(self) -> int:
        return next(self._ids)

    def check_free(self, name: str) -> None:
        """AdapterError (a 400) when an adapter of that name is loaded."""
        if name in self.by_name:
            raise AdapterError(f"a LoRA adapter named `{name}` is already loaded")

    def register(self, adapter_id: int, name: str, path: str) -> Adapter:
        self.check_free(name)
        adapter = self.by_name[name] = Adapter(adapter_id, name, path)
        return adapter

    def unregister(self, name: str) -> Adapter | None:
        adapter = self.by_name.pop(name, None)
        if adapter is not None:
            adapter.unloaded = True
            if adapter.requests == 0:
                self._let_go(adapter)
        return adapter

    def _let_go(self, adapter: Adapter) -> None:
        for slot, held in list(self._slots.items()):
            if held is adapter and not self._holders.get(slot):
                del self._slots[slot]  # free for the next adapter: nothing reads it any more
        self._forget(adapter.id)

    # -- requests --------------------------------------------------------------

    def request_added(self, adapter: Adapter) -> None:
        adapter.requests += 1

    def request_done(self, adapter: Adapter) -> None:
        adapter.requests -= 1
        if adapter.requests == 0 and adapter.unloaded:
            self._let_go(adapter)

    def acquire(self, adapter: Adapter) -> int | None:
        """The slot a request under `adapter` runs in, loading it there when
        it is not (the next plan carries the load); None while every slot is
        held by running requests."""
        slot = next((s for s, held in self._slots.items() if held is adapter), None)
        if slot is not None and slot in self._reload:
            self._reload.discard(slot)
            self._loads.append(AdapterLoad(slot, adapter.id, adapter.path))
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._slots[slot] = adapter
            self._loads.append(AdapterLoad(slot, adapter.id, adapter.path))
        self._slots.move_to_end(slot)
        self._holders[slot] = self._holders.get(slot, 0) + 1
        return slot

    def _free_slot(self) -> int | None:
        unused = next((s for s in range(1, self.max_loras + 1) if s not in self._slots), None)
        if unused is not None:
            return unused
        for slot, held in self._slots.items():  # least recently admitted first
            if not self._holders.get(slot):
                del self._slots[slot]
                self.evictions += 1
                logger.info("LoRA slot %d: adapter `%s` makes way", slot, held.name)
                return slot
        return None

    def release(self, slot: int) -> None:
        """A running request holding `slot` left it (finished, preempted, aborted)."""
        self._holders[slot] -= 1

    def loads_failed(self, loads: list[AdapterLoad]) -> None:
        """A step carrying `loads` failed: the slots may not hold those
        adapters (the engine fails any step that reads such a slot), so the
        next request admitted under one loads it again."""
        for load in loads:
            held = self._slots.get(load.slot)
            if held is not None and held.id == load.adapter_id:
                self._reload.add(load.slot)

    def take_loads(self) -> list[AdapterLoad]:
        """The loads the plan being built must carry (each once)."""
        loads, self._loads = self._loads, []
        return loads

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)
