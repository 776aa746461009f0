"""The base of every request model, and what the models of all routes
share: null means the default, refused fields name themselves, ranges come
from one table (aioserve/sampling_limits.py), logit_bias keys are token ids."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from aioserve.sampling_limits import Bound
from aioserve.server.intake.unhonoured_fields import refuse_unhonoured


def check_logit_bias_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    """JSON object keys are strings; logit_bias keys must spell token ids."""
    for key in value or {}:
        # ASCII digits only: str.isdigit() also takes "²" (int() fails) and "٣" (int() reads 3).
        if not re.fullmatch(r"-?[0-9]+", key):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    return value


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # Fields other servers take and aioserve cannot honour -> why: a 400 naming
    # the field when one asks for something (server/intake/unhonoured_fields.py).
    unhonoured: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        refuse_unhonoured(data, cls.unhonoured)
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def bounded(default: Any, bound: Bound) -> Any:
    """A field whose range is `bound`: pydantic checks it (a 400 naming the
    field) and the OpenAPI schema shows it."""
    return Field(
        default,
        ge=None if bound.low_open else bound.low, gt=bound.low if bound.low_open else None,
        le=None if bound.high_open else bound.high, lt=bound.high if bound.high_open else None,
    )
