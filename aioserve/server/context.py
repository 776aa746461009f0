"""What every handler needs: the scheduler, the tokenizer, the served name,
the request metrics, the image intake of a vision-language model, and the
server's state (serving, draining, failed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from aioserve.config import ServerArgs
from aioserve.images import ImageIntake
from aioserve.pooling_config import PoolerConfig
from aioserve.scheduler import SchedulerClient
from aioserve.scheduler.adapters import Adapter
from aioserve.server.body.checks import RequestLimits
from aioserve.server.body.parser_process import BodyParserProcess
from aioserve.server.errors import APIError
from aioserve.server.request_metrics import RequestMetrics
from aioserve.tokenizer import Tokenizer, started_pool

ADMITTING_KEY = "aioserve.admitting"  # in an HTTP scope: how many requests it reserved
RETRY_AFTER_S = 1  # what a 429 (queue full) or 503 (draining) tells the client to wait


class InFlight(Protocol):
    """A running generation, as the drain on shutdown sees it."""

    @property
    def finished(self) -> bool: ...

    def abort(self) -> None: ...

    def fail(self, reason: str) -> None: ...


# How much more text than the context a chat template may be handed: it may
# leave some out (earlier thinking), never most of it.
TEMPLATE_TEXT_FACTOR = 4


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
    # The model's sampling defaults for a request's unset fields (--generation-config).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    metrics: RequestMetrics = field(init=False)  # made from the served name
    # Set on SIGTERM/SIGINT: /health and new requests answer 503 while running ones finish.
    draining: bool = False
    # Generations not yet finished, for the drain to wait on: each leaves when
    # its last event is read or it is closed (Generation.close marks its
    # streams finished, so a client that left is not waited for).
    generations: set[InFlight] = field(default_factory=set)
    # Set when the server failed (a rank died or hung): why. Running requests
    # end with a 503 (or an SSE error event) saying so.
    failure: str | None = None
    # Requests accepted past --max-waiting-requests' check, not yet submitted.
    admitting: int = 0
    # Parses large request bodies in a process of its own (server/body/parser_process.py).
    body_parser: BodyParserProcess = field(default_factory=BodyParserProcess)
    # Builds and encodes large whole responses (server/output/assembly.py),
    # off the loop and beside the tokenizer's threads: two at a time.
    response_pool: ThreadPoolExecutor = field(default_factory=lambda: started_pool(2, "aioserve-response"))
    # A pooling model (embedder, reranker): how it pools; None for a generating model.
    pooler: PoolerConfig | None = None
    hidden_size: int = 0  # an embedding's full length
    score_row: str = "last"  # the row of a sequence a reranker's score head reads (first: BERT's [CLS])
    pooling_causal: bool = True  # False for an encoder: no prefix of its prompt is reused
    # A vision-language model's images (aioserve/images): None when the model takes text only.
    images: ImageIntake | None = None

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.model_name)

    @property
    def request_limits(self) -> RequestLimits:
        fields = {name: getattr(self.args, name) for name in RequestLimits.__dataclass_fields__ if name != "max_model_len"}
        return RequestLimits(**fields, max_model_len=self.max_model_len)

    @property
    def model_name(self) -> str:
        return self.args.model_name

    def check_model(self, name: str | None, param: str = "model") -> Adapter | None:
        """The LoRA adapter a request's model names (None: the base model,
        also when no name is given). OpenAI answers 404 model_not_found for a
        model it does not serve."""
        if name is None or name == self.model_name:
            return None
        adapter = self.scheduler.adapter(name)
        if adapter is not None:
            return adapter
        adapters = f" or one of its LoRA adapters ({', '.join(self.adapter_names)})" if self.adapter_names else ""
        raise APIError(
            f"The model `{name}` does not exist; this server serves `{self.model_name}`{adapters}.",
            status=404,
            param=param,
            code="model_not_found",
        )

    @property
    def adapter_names(self) -> list[str]:
        info = self.scheduler.info().lora
        return list(info.adapters) if info is not None else []

    def check_generates(self) -> None:
        """A generating route on a pooling model: a 400 saying what it serves."""
        if self.pooler is not None:
            routes = "/v1/embeddings" if self.pooler.task == "embed" else "/v1/rerank and /v1/score"
            raise APIError(
                f"this server serves `{self.model_name}` as a pooling model: it answers {routes}, and cannot "
                "generate (start it with --runner generate for a model that can)",
                code="model_not_generative",
            )

    def check_pools(self, task: str, route: str) -> PoolerConfig:
        """A pooling route on a model that does not pool that way: a 400 naming the flag."""
        if self.pooler is None:
            raise APIError(
                f"{route} needs a pooling model; this server serves `{self.model_name}` to generate "
                "(start the server with --runner pooling, SGLang's --is-embedding, for an embedding model)",
                code="model_not_pooling",
            )
        if task == "classify" and self.pooler.task != "classify":
            raise APIError(
                f"{route} needs a reranker (a *ForSequenceClassification checkpoint); `{self.model_name}` "
                "embeds: use /v1/embeddings",
                code="model_not_reranker",
            )
        if task == "embed" and self.pooler.task != "embed":
            raise APIError(f"`{self.model_name}` is a reranker: use /v1/rerank or /v1/score", code="model_not_embedder")
        return self.pooler

    def check_capacity(self, new_requests: int = 1, scope: MutableMapping[str, Any] | None = None) -> None:
        """--max-waiting-requests: refuse at once, before any tokenizing, when
        the queue is full, so that a load balancer can send the work elsewhere.
        Requests count from the moment they are accepted: those still being
        tokenized (`admitting`, reserved on the request's `scope` until
        `admitted`) as well as the scheduler's waiting ones; else a burst
        passes the check before any of it reaches the queue."""
        bound = self.args.max_waiting_requests
        if bound is None:
            return
        if new_requests > bound:  # never admissible, however empty the queue: not a retry
            raise APIError(
                f"this request asks for {new_requests} generations (prompts × n), more than the server queues "
                f"at once (--max-waiting-requests {bound})",
                param="n",
                code="request_too_large",
            )
        waiting = self.scheduler.num_waiting + self.admitting
        if waiting + new_requests > bound:
            raise APIError(
                f"the server is at capacity: {waiting} requests are waiting for admission "
                f"(--max-waiting-requests {bound}); retry later",
                status=429,
                type="rate_limit_exceeded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if scope is not None:
            self.admitting += new_requests
            scope[ADMITTING_KEY] = scope.get(ADMITTING_KEY, 0) + new_requests

    def set_aside(self, scope: MutableMapping[str, Any]) -> int:
        """The request's reservation leaves the waiting count while it waits
        on something other than the queue (its grammar compiling, up to
        --grammar-compile-timeout): eight slow compiles must not answer 429
        to everyone while the scheduler sits idle. Returns what it held."""
        held = scope.pop(ADMITTING_KEY, 0)
        self.admitting -= held
        return held

    def take_back(self, held: int, scope: MutableMapping[str, Any]) -> None:
        """The reservation set aside returns, checked against the bound as a
        new arrival's would be (the queue may have filled meanwhile)."""
        if held:
            self.check_capacity(held, scope)

    def admitted(self, scope: MutableMapping[str, Any]) -> None:
        """The request's reservation ends: its requests are in the scheduler's
        queue now, or it failed (endpoints/app.py's ServingGate calls this when a request ends)."""
        self.admitting -= scope.pop(ADMITTING_KEY, 0)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A prompt whose character count alone proves that it cannot fit the
        context gets its 400 without being tokenized (which, for megabytes of
        text, would take the CPU for seconds to a minute)."""
        at_least = self.tokenizer.min_tokens_for_chars(chars)
        if at_least > self.max_model_len:
            raise APIError(
                f"the prompt is too long: its {chars} characters make at least {at_least} tokens, "
                f"and this model's context is {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def check_template_chars(self, chars: int, param: str) -> None:
        """Everything a chat template is handed (messages of every role, tool
        definitions, template arguments) may be templated and tokenized
        whole, though a template may leave some out (Qwen3's drops earlier
        thinking): more than TEMPLATE_TEXT_FACTOR contexts of it gets its 400
        before the template runs (a 14 MB assistant message took 18 s to be
        refused after templating and tokenizing)."""
        at_least = self.tokenizer.min_tokens_for_chars(chars)
        if at_least > TEMPLATE_TEXT_FACTOR * self.max_model_len:
            raise APIError(
                f"the request's text is too long: the messages (every role), tools and template arguments "
                f"hold {chars} characters, at least {at_least} tokens for the chat template, more than "
                f"{TEMPLATE_TEXT_FACTOR} times this model's context of {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def encode_prompts(self, texts: list[str], param: str) -> list[list[int]]:
        """Every text checked by its length before any is tokenized."""
        for text in texts:
            self.check_prompt_chars(len(text), param)
        return [await self.tokenizer.encode_async(text) for text in texts]

    @property
    def healthy(self) -> bool:
        return not self.draining and (self.scheduler_task is None or not self.scheduler_task.done())
