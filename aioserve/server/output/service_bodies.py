"""The bodies of the endpoints that generate nothing: the served model
(/v1/models), the tokenizer as a service, the prefix cache's flush, the
server's configuration and counters, and SGLang's worker endpoints that
routers call (endpoints/worker_routes.py)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, create_model

from aioserve.scheduler import SchedulerInfo
from aioserve.server.wire import WireModel


# -- /v1/models ------------------------------------------------------------------


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str  # vLLM's extras: where the weights came from, and the context length
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); null for the base itself


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoraAdapterUpdate(BaseModel):
    """SGLang's answer to /load_lora_adapter and /unload_lora_adapter."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str]  # name -> folder


# -- /tokenize, /detokenize, /flush_cache, /server_info -----------------------------


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class FlushCacheResponse(BaseModel):
    flushed: bool


class TensorParallelInfo(BaseModel):
    tp_size: int
    nnodes: int
    ranks: list[dict[str, Any]]  # per rank: heads, KV heads, MLP columns, vocab rows, KV pool


class ServerConfigInfo(BaseModel):
    """What /server_info tells of the configuration."""

    model: str
    max_model_len: int
    overlap: bool
    cache: str
    tensor_parallel: TensorParallelInfo
    # The model's sampling defaults a request's unset fields take (--generation-config).
    generation_defaults: dict[str, Any] = {}
    # SGLang's names for what a router reads when a worker registers
    # (server/endpoints/worker_routes.py): its served name, model and sizes.
    served_model_name: str
    model_path: str
    tp_size: int
    dp_size: int  # replicas inside this server: always 1 (--dp runs each as a server of its own)
    max_running_requests: int
    version: str


def _scheduler_info_fields() -> dict[str, Any]:
    hints = typing.get_type_hints(SchedulerInfo)
    return {field.name: (hints[field.name], ...) for field in dataclasses.fields(SchedulerInfo)}


# GET /server_info: the configuration and the scheduler's snapshot, flattened.
# The snapshot's fields are SchedulerInfo's own (scheduler/client.py), read
# from the dataclass, so a counter added there reaches /server_info and the
# OpenAPI document with no copy kept here.
ServerInfo = create_model(
    "ServerInfo", __base__=ServerConfigInfo, __doc__="GET /server_info", **_scheduler_info_fields()
)


# -- SGLang's worker endpoints -----------------------------------------------------


class ModelInfo(WireModel):
    """GET /model_info (and /get_model_info), SGLang's fields."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    is_generation: bool
    preferred_sampling_params: dict | None
    weight_version: str
    has_image_understanding: bool
    has_audio_understanding: bool
    architectures: list[str]
    max_context_length: int
    vocab_size: int


class WorkerLoad(WireModel):
    """One entry of GET /get_load: SGLang answers a list, one per
    data-parallel rank inside the server (aioserve has one); the router
    sums num_tokens as the worker's load."""

    dp_rank: int
    num_reqs: int  # running and waiting
    num_waiting_reqs: int
    num_tokens: int  # KV tokens held by requests


class VersionInfo(WireModel):
    version: str
