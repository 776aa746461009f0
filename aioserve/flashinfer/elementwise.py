"""Whether RMSNorm, RoPE and SiLU-and-mul run as FlashInfer's fused CUDA kernels.

On CUDA a small step is bound by kernel launches, and the torch forms of
these ops are several kernels each (RoPE about ten); FlashInfer has one
fused kernel for each (RMSNorm with the residual add, RoPE in place from a
cos/sin cache, SiLU-and-mul), the ones SGLang uses.

A fused kernel is taken only where its contract (contracts.py) holds: half
precision, the layout and the 16-byte alignment its vector loads need, a
head dim it is built for. The check runs once per input layout
(dtype, device, trailing shape, strides, pointer alignment: not per token),
each `FusedOp` keeps its decisions, and the first fall-back for a reason is
logged once. float32 math, CPU tensors, a missing FlashInfer, or
AIOSERVE_FLASHINFER_ELEMENTWISE=0 (or `ENABLED = False`, read at every
call) leave the torch forms in charge. benchmarks/gpu_check.sh times steps
with them and without.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from types import ModuleType

import torch

from aioserve.flashinfer import contracts
from aioserve.flashinfer.loader import load_flashinfer

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("AIOSERVE_FLASHINFER_ELEMENTWISE", "1") != "0"
HALF = contracts.HALF
DEVICE_TYPES = ("cuda",)  # the CPU tests add "cpu" to run a stand-in through the same calls

# One input's part in a layout's key: what a contract can depend on, minus the token count.
LayoutKey = tuple[torch.dtype, str, tuple[int, ...], tuple[int, ...], int]


def _layout(t: torch.Tensor) -> LayoutKey:
    return (t.dtype, t.device.type, tuple(t.shape[1:]), t.stride(), t.data_ptr() % contracts.ALIGNMENT)


class FusedOp:
    """One fused entry point: which input layouts it may take, decided once each."""

    def __init__(self, name: str, contract: Callable[..., str | None]) -> None:
        self.name = name
        self.contract = contract
        self.decisions: dict[tuple[LayoutKey, ...], str | None] = {}  # layout -> why not fused (None: fused)
        self._logged: set[str] = set()

    def load(self) -> ModuleType | None:
        """The kernels' module: FlashInfer (an op of aioserve's own overrides this)."""
        return load_flashinfer()

    def may_take(self, first: torch.Tensor) -> bool:
        """The cheap part, read at every call: enabled, a device the kernel
        runs on, half precision, its module imported."""
        if not (ENABLED and first.device.type in DEVICE_TYPES and first.dtype in HALF):
            return False
        return self.load() is not None

    def kernel(self, *tensors: torch.Tensor) -> ModuleType | None:
        """The kernels' module when these inputs may go to the fused kernel,
        else None (the caller runs the torch form). `tensors` are the contract's arguments."""
        if not self.may_take(tensors[0]):
            return None
        key = tuple(_layout(t) for t in tensors)
        if key not in self.decisions:
            why = self.contract(*tensors)
            self.decisions[key] = why
            if why is not None and why not in self._logged:
                self._logged.add(why)
                logger.info("%s: the torch form, not FlashInfer's kernel, because %s", self.name, why)
        return self.load() if self.decisions[key] is None else None

    def fell_back(self) -> set[str]:
        return {why for why in self.decisions.values() if why is not None}

    def asked(self) -> bool:
        """Whether some layer asked for this op (and so has something to report)."""
        return bool(self.decisions)

    def forget(self) -> None:
        self.decisions.clear()
        self._logged.clear()

    def fused(self) -> bool:
        """Whether some layout took the fused kernel."""
        return any(why is None for why in self.decisions.values())


class SelfCheckedOp(FusedOp):
    """A fused op that also proves itself on the device before it serves: the
    contract's decisions per layout, as every op keeps them, and a
    self-check's verdict per key (a shape, a dtype; None: it passed), run once
    each. A failed self-check counts as a fall-back in the report."""

    refusal_level = logging.WARNING  # a failed self-check is a fault worth seeing, unless the op says otherwise

    def __init__(self, name: str, contract: Callable[..., str | None]) -> None:
        super().__init__(name, contract)
        self.verdicts: dict[Hashable, str | None] = {}

    def checked(self, key: Hashable, self_check: Callable[[], str | None], serves: str) -> str | None:
        """The verdict for `key`, running `self_check` the first time; `serves`
        names what the kernel then serves, for the log."""
        if key not in self.verdicts:
            why = self_check()
            self.verdicts[key] = why
            if why is not None:
                logger.log(self.refusal_level, "%s: the torch form, not the fused kernel, because %s", self.name, why)
            else:
                logger.info("%s: the fused kernel serves %s", self.name, serves)
        return self.verdicts[key]

    def fused(self) -> bool:
        return any(why is None for why in self.verdicts.values())

    def fell_back(self) -> set[str]:
        return super().fell_back() | {why for why in self.verdicts.values() if why is not None}

    def asked(self) -> bool:
        return bool(self.decisions or self.verdicts)

    def forget(self) -> None:
        super().forget()
        self.verdicts.clear()


RMSNORM = FusedOp("rmsnorm", contracts.rmsnorm)
FUSED_ADD_RMSNORM = FusedOp("fused_add_rmsnorm", contracts.fused_add_rmsnorm)
ROPE = FusedOp("rope", contracts.rope)
SILU_AND_MUL = FusedOp("silu_and_mul", contracts.silu_and_mul)
FUSED_OPS = (RMSNORM, FUSED_ADD_RMSNORM, ROPE, SILU_AND_MUL)
# Ops only some models call (moe.py's fused MoE), added by their modules;
# reported once a layer asked for them.
MODEL_OPS: list[FusedOp] = []
GELU_TANH_AND_MUL = FusedOp("gelu_tanh_and_mul", contracts.gelu_tanh_and_mul)  # Gemma's GeGLU
MODEL_OPS.append(GELU_TANH_AND_MUL)


def forget_decisions() -> None:
    """Start every op's decisions afresh (tests that swap the module or the devices)."""
    for op in (*FUSED_OPS, *MODEL_OPS):
        op.forget()


def report() -> dict[str, dict[str, object]]:
    """Per op: whether it was fused for some layout, and every reason it was not."""
    ops = (*FUSED_OPS, *(op for op in MODEL_OPS if op.asked()))
    return {op.name: {"fused": op.fused(), "fell_back": sorted(op.fell_back())} for op in ops}
