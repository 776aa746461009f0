"""The CPU's fast paths, behind one object: the native packed matmul's
weights (bf16 ones multiplied on AMX tiles where the CPU has them; or, for
float16 math on AMX, weights reordered once for oneDNN), the
decode-only step as one native DecoderStack call, and greedy rows' tokens
from the LM head (the screen of a float32 head; a half head's argmax as it
computes).

Which of them apply on this CPU is decided once, with the reasons, in
cpu/dispatch.py; the model's own limits are checked here. All of them need
the native kernels (aioserve/cpu/native.py). When they are still
building, the engine starts with BLAS (tuned) and the torch forms, and
`upgrade()`, the single point where that changes, called between steps on
the thread that runs them (nothing else reads the weights then), packs the
weights and starts the native paths once the kernels are in.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

import torch
from torch import nn

from aioserve.cpu.dispatch import CpuDispatch
from aioserve.cpu_engine.greedy_screen import GreedyScreen
from aioserve.cpu_engine.head_argmax import HeadArgmax
from aioserve.cpu_engine.decode_stack import NativeDecodeRunner, unsupported_reason
from aioserve.kvcache.kv_pool import KVPool
from aioserve.layers.moe import FusedMoE
from aioserve.models.causal_lm import CausalLM
from aioserve.cpu.matmul import MatmulModule, pack_cpu_weights, tune_cpu_matmuls
from aioserve.cpu.native import cpu_kernels
from aioserve.cpu.onednn_weights import pack_for_onednn, shared_parameters

logger = logging.getLogger(__name__)


class CpuFastPaths:
    def __init__(
        self, model: CausalLM, pool: KVPool, dispatch: CpuDispatch, weight_dtype: torch.dtype, generates: bool = True
    ) -> None:
        """`generates`: False for a pooling model, which only computes prompts:
        its weights are packed, but no decode runner or greedy screen is made."""
        self.model, self.pool, self.dispatch = model, pool, dispatch
        self.generates = generates
        self.weight_dtype, self.dtype = weight_dtype, dispatch.math_dtype
        self.decode_runner: NativeDecodeRunner | None = None
        self.greedy_screen: GreedyScreen | HeadArgmax | None = None
        # Weights waiting to be packed for the native matmul (the kernels are building).
        self._unpacked: list[MatmulModule] = []
        # A layer holding quantised weights multiplies through its LinearQuant (FP8), never the CPU's.
        matmuls = cast("list[MatmulModule]", [m for m in model.modules() if hasattr(m, "matmul_choice")
                                              and getattr(m, "quant", None) is None])
        if dispatch.packed_matmul and pack_cpu_weights(matmuls, weight_dtype):
            self._pack_experts()
        else:
            for module in matmuls:  # BLAS and oneDNN multiply at the math's width
                module.weight.data = module.weight.data.to(self.dtype)
            # Weights a tied embedding also reads (a oneDNN reorder keeps their plain copy).
            shared = shared_parameters(cast(nn.Module, model), matmuls) if dispatch.onednn != "off" else set()
            reordered = dispatch.onednn == "always" and self._reorder_for_onednn(matmuls, shared)
            if dispatch.packed_matmul:  # the kernels are building: packed once they are in
                self._unpacked = matmuls
            if dispatch.blas_tuning and not reordered:
                tune_cpu_matmuls(matmuls, onednn=dispatch.onednn == "timed")
                # The weight shapes oneDNN's layout was timed faster for.
                won = [m for m in matmuls if m.matmul_choice is not None and m.matmul_choice.onednn]
                if won and not self._reorder_for_onednn(won, shared):
                    for module in won:  # the row-major BLAS forms the tuner kept for this
                        assert module.matmul_choice is not None
                        module.matmul_choice = dataclasses.replace(module.matmul_choice, onednn=False)
        self._start_native_paths()

    @staticmethod
    def _reorder_for_onednn(modules: list[MatmulModule], shared: set[int]) -> bool:
        """Reorder the modules' weights for oneDNN (all or none); False, logged, when refused."""
        refused = pack_for_onednn(modules, shared)
        if refused is not None:
            logger.warning("CPU path: oneDNN's weight layout refused, BLAS forms instead: %s", refused)
        return refused is None

    def upgrade(self) -> bool:
        """Between steps: once the kernels are built, pack the weights and
        start the native paths. True when that happened (the engine then
        takes the new decode runner)."""
        if not self._unpacked or cpu_kernels(wait=False) is None:
            return False
        if pack_cpu_weights(self._unpacked, self.weight_dtype):
            self._pack_experts()
        self._unpacked = []
        self._start_native_paths()
        return True

    def _pack_experts(self) -> None:
        """A mixture of experts' stacked weights, packed per expert alike."""
        kernels = cpu_kernels(wait=False)
        assert kernels is not None  # the dense weights were just packed
        for module in self.model.modules():
            if isinstance(module, FusedMoE):
                module.pack_for_cpu(kernels, self.weight_dtype)

    def _start_native_paths(self) -> None:
        if not self.generates:
            return
        self._start_native_decode()
        kernels = cpu_kernels(wait=False)
        if kernels is not None and self.model.logits_are_head_outputs:
            # Greedy rows' argmax from a half copy of a float32 LM head
            # (greedy_screen.py), or from a half one as it computes (head_argmax.py).
            lm_head = self.model.lm_head
            self.greedy_screen = GreedyScreen.build(lm_head, kernels, self.dispatch.screen_dtype)
            if self.greedy_screen is None and self.dispatch.head_argmax:
                self.greedy_screen = HeadArgmax.build(lm_head, kernels, self.dispatch.int8_head_screen)

    def _start_native_decode(self) -> None:
        """Decode-only steps through the native DecoderStack when this CPU's
        path has it and the model's layers allow it (otherwise, once, the
        model's reason in the log; the CPU's is logged at load)."""
        if not self.dispatch.native_decode:
            return
        reason = unsupported_reason(self.model, self.pool.buffer.device)
        if reason is None:
            kernels = cpu_kernels(wait=False)
            assert kernels is not None
            self.decode_runner = NativeDecodeRunner(self.model, self.pool, kernels)
            logger.info("decode-only steps run as one native call (DecoderStack)")
        elif not self._unpacked:  # while the kernels build, packing comes later and this is retried
            logger.info("decode steps run the modules: %s", reason)
