"""Request bodies of the LoRA routes: vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, and SGLang's unversioned pair (same fields)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictStr

from aioserve.server.intake.request_model import RequestModel

Name = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class LoadLoraAdapterRequest(RequestModel):
    lora_name: Name
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(RequestModel):
    lora_name: Name
    lora_path: StrictStr | None = None  # vLLM's body may carry it; the name decides
    lora_int_id: int | None = None
