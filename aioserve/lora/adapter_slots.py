"""The engine's side of LoRA: every adaptable layer's slots, the adapters
read into host memory, and each step's loads and routing.

Adapters are read (from their folder, checked and laid out for this rank)
into a host cache bounded by --max-cpu-loras, least recently used first out.
Rank 0 reads an adapter when it is loaded, off the event loop (`preload`,
from the server's thread pool); a step that names a slot load copies the
host copy into the slot (a few MB), reading the folder first only when the
host cache had let it go, or on a follower rank the first time. Which
adapter goes to which slot is the scheduler's choice (scheduler/adapters.py):
the plan says it, so every rank loads alike.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from aioserve.batch_plan import AdapterLoad, BatchPlan
from aioserve.cpu.native import cpu_kernels
from aioserve.layers.lora import LoraRouting, LoraSlots, LoraStepState, route_rows
from aioserve.lora.host_layout import HostAdapter, adaptable_layers, lay_out, part_columns, part_ids
from aioserve.lora.peft_folder import read_peft_adapter
from aioserve.lora_config import LoraConfig
from aioserve.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


class AdapterSlots:
    def __init__(
        self, model: nn.Module, model_config: ModelConfig, config: LoraConfig, dtype: torch.dtype, device: torch.device,
        storage_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the math's; `storage_dtype`: the weights' when narrower
        (the CPU's native copies of the slots are kept in it, as the weights are).
        --lora-dtype (config.dtype) overrides the latter: the adapters are
        rounded to it as they are read, and kept at that width where narrower."""
        self.model, self.model_config, self.config = model, model_config, config
        self.dtype, self.device = dtype, device
        # The adapters' own dtype: their values are rounded to it whatever width holds them.
        self.weights_dtype: torch.dtype | None = getattr(torch, config.dtype) if config.dtype else None
        if self.weights_dtype is not None:
            storage_dtype = self.weights_dtype
        self.state = LoraStepState()
        self.layers = adaptable_layers(model)
        num_slots, band = config.max_loras + 1, config.max_lora_rank  # slot 0: the base model, always zero
        for layer in self.layers.values():
            parts = part_ids(layer)
            rows = band * len(parts)
            layer.lora = LoraSlots(
                torch.zeros(num_slots, rows, layer.in_features, dtype=dtype, device=device),
                torch.zeros(num_slots, rows, layer.out_features, dtype=dtype, device=device),
                self.state,
                native_dtype=storage_dtype if storage_dtype is not None and storage_dtype.itemsize < dtype.itemsize
                else None,
                columns=part_columns(layer),
            )
        self.num_slots = num_slots
        self.slot_adapter: list[int | None] = [None] * num_slots  # which adapter id each slot holds
        self.native_ready = False  # the slots also copied for the CPU's native kernel (layers/lora.py)
        self._host: OrderedDict[int, HostAdapter] = OrderedDict()
        self._lock = threading.Lock()  # preload runs on the server's threads, loads on the forward's
        self.slot_loads = 0
        self.reads = 0  # adapter folders read (again, for one that left host memory)

    @property
    def nbytes(self) -> int:
        return sum(layer.lora.a.nbytes + layer.lora.b.nbytes for layer in self.layers.values() if layer.lora)

    def read(self, path: str) -> HostAdapter:
        """Read, check and lay out an adapter (any thread); AdapterError if it cannot be served."""
        adapter = read_peft_adapter(path, self.config.max_lora_rank)
        self.reads += 1
        host = lay_out(adapter, self.model, self.model_config, self.config.max_lora_rank, self.dtype)
        if self.weights_dtype is not None and self.weights_dtype != self.dtype:
            host = host.rounded_to(self.weights_dtype)
        return host

    def preload(self, adapter_id: int, path: str) -> None:
        """Read adapter `adapter_id` into the host cache (off the event loop)."""
        host = self.read(path)
        with self._lock:
            self._remember(adapter_id, host)
        logger.info("LoRA adapter %d read from %s: %d layers, %.1f MiB", adapter_id, path, len(host.layers),
                    host.nbytes / 2**20)

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter: its host copy goes (its slot is simply reused)."""
        with self._lock:
            self._host.pop(adapter_id, None)

    def _remember(self, adapter_id: int, host: HostAdapter) -> None:
        self._host[adapter_id] = host
        self._host.move_to_end(adapter_id)
        bound = self.config.max_cpu_loras
        while bound is not None and len(self._host) > bound:
            dropped, _ = self._host.popitem(last=False)
            logger.info("LoRA adapter %d leaves host memory (--max-cpu-loras %d)", dropped, bound)

    def _host_copy(self, load: AdapterLoad) -> HostAdapter:
        with self._lock:
            host = self._host.get(load.adapter_id)
            if host is not None:
                self._host.move_to_end(load.adapter_id)
                return host
        logger.info("LoRA adapter %d not in host memory: reading %s", load.adapter_id, load.path)
        host = self.read(load.path)
        with self._lock:
            self._remember(load.adapter_id, host)
        return host

    def apply_loads(self, loads: list[AdapterLoad]) -> None:
        """Copy each load's adapter into its slot (on the forward's thread and
        stream, so in order with the steps: the slot's last user ran before).
        The native copies follow whatever was copied, even when a later load fails."""
        try:
            self._copy_loads(loads)
        finally:
            if loads and self.native_ready:
                self._prepare_native([load.slot for load in loads])

    def _copy_loads(self, loads: list[AdapterLoad]) -> None:
        for load in loads:
            try:
                host = self._host_copy(load)
            except Exception:
                # The slot's old adapter is gone for the scheduler: a step
                # that names the slot anyway fails (route) instead of running
                # on the wrong weights.
                self.slot_adapter[load.slot] = None
                raise
            for name, layer in self.layers.items():
                slots = layer.lora
                assert slots is not None
                weights = host.layers.get(name)
                if weights is None:
                    slots.a[load.slot].zero_()
                    slots.b[load.slot].zero_()
                else:
                    slots.a[load.slot].copy_(weights[0], non_blocking=True)
                    slots.b[load.slot].copy_(weights[1], non_blocking=True)
            self.slot_adapter[load.slot] = load.adapter_id
            self.slot_loads += 1

    def _prepare_native(self, slots: list[int] | None = None) -> None:
        """Copy the slots for the native kernel (`slots` again after loads,
        None: all); once the kernels are built (a server may start before
        its background build lands)."""
        if cpu_kernels(wait=False) is None:
            return
        self.native_ready = all([layer.lora.prepare_native(slots) for layer in self.layers.values()
                                 if layer.lora is not None])

    @contextmanager
    def routed(self, routing: LoraRouting | None) -> Iterator[None]:
        """The modules' forward under `routing` (cleared after, also on an error)."""
        self.state.routing = routing
        try:
            yield
        finally:
            self.state.routing = None

    def route(self, host_plan: BatchPlan) -> LoraRouting | None:
        """Each token's slot, from its request's (the plan's rows are the requests' tokens in order)."""
        lora = host_plan.lora
        if lora is None:
            return None
        if not self.native_ready and self.device.type == "cpu":
            self._prepare_native()
        token_slots: list[int] = []
        for slot, count in zip(lora.request_slots.tolist(), host_plan.extend_lens.tolist()):
            if slot and self.slot_adapter[slot] is None:
                raise RuntimeError(f"LoRA slot {slot} holds no adapter (its load failed)")
            token_slots += [slot] * count
        return route_rows(token_slots, self.num_slots, self.device, self.dtype)
