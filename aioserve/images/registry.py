"""The vision-language families intake knows, by config.json's
architectures[0]; a checkpoint of any other architecture takes text only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aioserve.images.family import VisionFamily
from aioserve.images.gemma3_vl import Gemma3Vision
from aioserve.images.qwen_vl import QwenVL

FAMILIES: tuple[type[VisionFamily], ...] = (QwenVL, Gemma3Vision)


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json ({} when it has none)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return config if isinstance(config, dict) else {}


def architecture(config: dict[str, Any]) -> str | None:
    architectures = config.get("architectures")
    return architectures[0] if isinstance(architectures, list) and architectures else None


def family_class(config: dict[str, Any]) -> type[VisionFamily] | None:
    """The family of a checkpoint that takes images (None: text only)."""
    name = architecture(config)
    return next((family for family in FAMILIES if name in family.architectures and family.applies(config)), None)
