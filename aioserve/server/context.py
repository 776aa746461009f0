"""What every handler needs: the scheduler, the tokenizer, the served name."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aioserve.config import ServerArgs
from aioserve.scheduler import SchedulerClient
from aioserve.server.errors import APIError
from aioserve.tokenizer import Tokenizer


@dataclass
class ServingContext:
    args: ServerArgs
    scheduler: SchedulerClient
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    scheduler_task: asyncio.Task | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    # What each tensor-parallel rank holds (engine/tp_layout.py), for /server_info.
    tp_layout: list[dict[str, Any]] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.args.model_name

    def check_model(self, name: str | None) -> None:
        """OpenAI answers 404 model_not_found for a model it does not serve.
        An absent name means the one we serve."""
        if name is not None and name != self.model_name:
            raise APIError(
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                status=404,
                param="model",
                code="model_not_found",
            )

    @property
    def healthy(self) -> bool:
        return self.scheduler_task is None or not self.scheduler_task.done()
