"""The optional `flashinfer` module (the gpu extra), imported on first use.

One import for the whole process: the fused elementwise ops
(elementwise.py), the fused MoE (moe.py) and the paged attention backend
(attention/flashinfer.py) all ask `load_flashinfer`. Without the extra (or
on a machine it does not import on) the answer is None, `import_error`
says why, and every caller takes its torch form.
"""

from __future__ import annotations

import logging
from types import ModuleType

logger = logging.getLogger(__name__)

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
