"""The optional `flashinfer` module (the gpu extra), imported on first use.

One import for the whole process: the fused elementwise ops
(elementwise.py), the fused MoE (moe.py) and the paged attention backend
(attention/flashinfer.py) all ask `load_flashinfer`. Without the extra (or
on a machine it does not import on) the answer is None, `import_error`
says why, and every caller takes its torch form.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

class OptionalModule:
    """A module imported on first use, once for the whole process; None where
    it does not import, and `import_error` says why. Tests put a stand-in in
    `module` (with `tried` set)."""

    def __init__(self, name: str, importer: Callable[[], Any], without: str) -> None:
        self.name, self.importer, self.without = name, importer, without
        self.module: Any = None
        self.tried = False
        self.import_error: str | None = None

    def load(self) -> Any:
        if not self.tried:
            self.tried = True
            try:
                self.module = self.importer()
            except ImportError as exc:
                self.import_error = str(exc)
                logger.info("%s does not import (%s): %s", self.name, exc, self.without)
        return self.module


# The gpu extra (an optional dependency: imported by name, on first use).
FLASHINFER = OptionalModule("flashinfer", lambda: importlib.import_module("flashinfer"), "torch serves its ops")


def load_flashinfer() -> ModuleType | None:
    """The optional `flashinfer` module (the gpu extra), imported once for the
    whole process (these ops and the attention backend); None if it does not
    import, and FLASHINFER.import_error says why."""
    module: ModuleType | None = FLASHINFER.load()
    return module
