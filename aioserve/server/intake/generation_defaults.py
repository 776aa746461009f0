"""The model's own sampling defaults (--generation-config), as vLLM applies
them: the sampling fields of its generation_config.json become the values a
request's unset fields take. Qwen3's says temperature 0.6, top_p 0.95,
top_k 20; a request that sets temperature still gets its own.

`auto` reads the served model's folder, a folder path reads that folder's
file, and `vllm` or `none` keep aioserve's neutral defaults (temperature 1,
top_p 1, no top_k). Like vLLM, `do_sample` is not read: a config that lists
a temperature means it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

# generation_config.json's name -> the request field it is the default of.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
NEUTRAL = ("vllm", "none")


def load_generation_defaults(option: str, model_path: str | Path) -> dict[str, Any]:
    """Request field -> its default from the generation config (only the
    fields the file sets). A folder named by the option must hold the file."""
    if option in NEUTRAL:
        return {}
    folder = Path(model_path) if option == "auto" else Path(option)
    path = folder / "generation_config.json"
    if not path.is_file():
        if option != "auto":
            raise FileNotFoundError(f"--generation-config {option}: no generation_config.json in that folder")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--generation-config: {path} is not readable JSON ({exc})") from None
    defaults = {field: raw[name] for name, field in FIELDS.items() if isinstance(raw.get(name), (int, float))}
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s", path, defaults)
    return defaults


def or_default(fields: BaseModel, name: str, defaults: Mapping[str, Any] | None, neutral: Any) -> Any:
    """The request's value when it set one (an explicit null counts as
    unset: openai_requests.RequestModel drops nulls), else the model's default,
    else the neutral one."""
    if name in fields.model_fields_set:
        return getattr(fields, name)
    return (defaults or {}).get(name, neutral)
