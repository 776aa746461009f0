"""Whether RMSNorm, RoPE and SiLU-and-mul run as FlashInfer's fused CUDA kernels.

On CUDA a small step is bound by kernel launches, and the torch forms of
these ops are several kernels each (RoPE about ten); FlashInfer has one
fused kernel for each (RMSNorm with the residual add, RoPE in place from a
cos/sin cache, SiLU-and-mul), the ones SGLang uses. They take half precision
only; float32 math, CPU tensors, a missing FlashInfer, or
AIOSERVE_FLASHINFER_ELEMENTWISE=0 (or `ENABLED = False`, read at every
call) leave the torch forms in charge. benchmarks/gpu_check.sh times steps
with them and without.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("AIOSERVE_FLASHINFER_ELEMENTWISE", "1") != "0"
HALF = (torch.float16, torch.bfloat16)
DEVICE_TYPES = ("cuda",)  # the CPU tests add "cpu" to run a torch stand-in through the same calls

_flashinfer: ModuleType | None = None
_tried = False
import_error: str | None = None  # why flashinfer did not import, once tried


def load_flashinfer() -> ModuleType | None:
    """The optional `flashinfer` module (the gpu extra), imported once for the
    whole process (these ops and the attention backend); None if it does not
    import, and `import_error` says why."""
    global _flashinfer, _tried, import_error
    if not _tried:
        _tried = True
        try:
            import flashinfer  # noqa: PLC0415 - the optional gpu extra

            _flashinfer = flashinfer
        except ImportError as exc:
            import_error = str(exc)
            logger.info("flashinfer does not import (%s): torch serves its ops", exc)
    return _flashinfer


def flashinfer_ops(x: torch.Tensor) -> ModuleType | None:
    """FlashInfer for this CUDA half-precision tensor, or None for the torch forms."""
    if not (ENABLED and x.device.type in DEVICE_TYPES and x.dtype in HALF):
        return None
    return load_flashinfer()
