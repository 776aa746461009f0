"""The offline API: generate for a list of prompts in this process.

    from aioserve import LLM, SamplingParams
    llm = LLM("path/to/model")
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))

It drives the same scheduler the server uses (continuous batching, prefix
cache, chunked prefill, overlap) on a private event loop. `LLM(path, tp=2)`
(also `tp_size=2` or vLLM's `tensor_parallel_size=2`) runs tensor-parallel:
this process is rank 0 and starts the other ranks as child processes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from tqdm import tqdm

from aioserve.config import DEMO_MODEL, EngineConfig
from aioserve.grammar import compiler_for
from aioserve.image_inputs import PromptImages
from aioserve.images import MediaSettings, load_image_intake
from aioserve.images.offline import OfflineImages
from aioserve.output_stream import OutputStream, PromptLogprobs, TopLogprobs
from aioserve.sampling_params import SamplingParams
from aioserve.launch.wiring import build_scheduler
from aioserve.pooling_config import PoolerConfig, pair_text
from aioserve.scheduler.adapters import Adapter
from aioserve.scheduler.pooling import PooledOutput, PoolingState, embedding_vector, relevance
from aioserve.scheduler.request import Request, RequestEvent
from aioserve.tokenizer import Tokenizer, started_pool

Prompt = str | list[int]
# vLLM's prompt with images: {"prompt": text or "prompt_token_ids": ids,
# "multi_modal_data": {"image": a PIL image, a URL, or a list of them}}, the
# prompt holding the model's image marker once per image.
MultiModalPrompt = dict[str, Any]


@dataclass(frozen=True)
class _Encoded:
    """A prompt already encoded with its images (a conversation of LLM.chat)."""

    ids: list[int]
    images: PromptImages | None
# A prompt's LoRA adapter: a loaded one's name, an object with lora_name and
# lora_path (vLLM's LoRARequest), or None for the base model.
LoraChoice = str | Any | None


@dataclass
class EmbeddingOutput:
    prompt_token_ids: list[int]
    embedding: list[float]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or several."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]
    return list(cast(Sequence[Prompt], prompts))


@dataclass
class GenerationOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each chosen token
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    num_cached_tokens: int = 0


def _tp_size_option(options: dict[str, Any]) -> None:
    """`tp` and `tensor_parallel_size` are other names of EngineConfig.tp_size."""
    given = {name: options.pop(name) for name in ("tp", "tensor_parallel_size", "tp_size") if name in options}
    if len(set(given.values())) > 1:
        raise ValueError(f"conflicting tensor-parallel sizes: {given}")
    if given:
        options["tp_size"] = next(iter(given.values()))


class LLM:
    def __init__(self, model: str = DEMO_MODEL, **engine_options: Any) -> None:
        chat_template = engine_options.pop("chat_template", None)
        allowed_local_media_path = engine_options.pop("allowed_local_media_path", None)  # vLLM's, for file:// images
        _tp_size_option(engine_options)
        self.config = EngineConfig(model=model, **engine_options)
        self._loop = asyncio.new_event_loop()
        self._run: asyncio.Task | None = None
        self.tp_failure: str | None = None  # why the tensor-parallel group broke
        self.engine, self.scheduler = build_scheduler(self.config, on_tp_failure=self._on_tp_failure)
        self.tokenizer = Tokenizer(self.config.tokenizer or self.engine.model_path, chat_template)
        self._ids = itertools.count()
        intake = load_image_intake(
            self.engine.model_path, MediaSettings(allowed_local_path=allowed_local_media_path),
            self.tokenizer.run_async, partial(started_pool, 2, "aioserve-media"), self.tokenizer.rust.token_to_id,
        )
        self.images = OfflineImages(intake, self._loop) if intake is not None else None

    def encode(self, prompt: Prompt) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def _with_images(self, prompt: Prompt | MultiModalPrompt | _Encoded) -> tuple[list[int], PromptImages | None]:
        """A prompt's ids, and its images where it is vLLM's dict form."""
        if isinstance(prompt, _Encoded):
            return prompt.ids, prompt.images
        if not isinstance(prompt, dict):
            return self.encode(prompt), None
        ids = list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else self.encode(prompt["prompt"])
        images = (prompt.get("multi_modal_data") or {}).get("image")
        if images is None:
            return ids, None
        if self.images is None:
            raise ValueError("this model takes text only: multi_modal_data needs a vision-language model")
        return self.images.prompt(ids, images if isinstance(images, list) else [images])

    def generate(
        self,
        prompts: Prompt | MultiModalPrompt | Sequence[Prompt | MultiModalPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoraChoice | Sequence[LoraChoice] = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, token ids, or vLLM's dict with
        `multi_modal_data` images), all batched together.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt
        (None: the base model): a loaded adapter's name, or an object with
        `lora_name` and `lora_path` (vLLM's LoRARequest), loaded on first use."""
        self._check_tp()
        if isinstance(prompts, (str, dict, _Encoded)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        choices = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(choices) != len(prompts):
            raise ValueError("give one lora_request, or one per prompt")
        adapters = [self._adapter(choice) for choice in choices]
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        try:
            outputs, requests = self._prepare(cast(Sequence[Prompt | MultiModalPrompt | _Encoded], prompts),
                                              sampling_params, bar)
        except BaseException:
            bar.close()
            raise
        for request, adapter in zip(requests, adapters):
            request.adapter = adapter
        self._run_requests(requests, bar)
        return outputs

    def _run_requests(self, requests: list[Request], bar: tqdm) -> None:
        """Submit `requests` together and run the scheduler until they end."""
        integrity_failures = len(self.scheduler.integrity_failures)
        rids = [request.rid for request in requests]
        try:
            # Checked together, queued together: a rejected prompt (a
            # ValueError) leaves none of the call's others queued for the next call.
            self.scheduler.submit_all(requests)
            self._run = self._loop.create_task(self.scheduler.run(until_idle=True))
            self._loop.run_until_complete(self._run)
        except asyncio.CancelledError:
            if self.tp_failure is None:
                raise
        finally:
            self._run = None
            for rid in rids:  # on an interrupt, leave nothing behind
                self.scheduler.abort(rid)
            bar.close()
        self._check_tp()
        if len(self.scheduler.integrity_failures) > integrity_failures:
            # --debug-integrity found the KV bookkeeping broken (and reset it);
            # a debugging run must hear of it, not only read it in the log.
            raise RuntimeError(f"KV integrity check failed: {self.scheduler.integrity_failures[-1]}")

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """A pooling model's embedding of every prompt (text, or token ids),
        all batched together; `dimensions` truncates (Matryoshka models)."""
        pooler = self._pooler("embed")
        pooled = self._pool(pooler, [self.encode(p) for p in _prompt_list(prompts)], score=False, use_tqdm=use_tqdm)
        return [EmbeddingOutput(ids, embedding_vector(out, pooler.normalize, dimensions)) for ids, out in pooled]

    def score(self, text_1: str, text_2: str | Sequence[str], use_tqdm: bool = False) -> list[float]:
        """A cross-encoder's relevance of each `text_2` to `text_1`, in [0, 1]."""
        pooler = self._pooler("classify")
        pairs = [text_2] if isinstance(text_2, str) else list(text_2)
        prompts = [self.tokenizer.encode_pair(text_1, d, pair_text(pooler, text_1, d)) for d in pairs]
        pooled = self._pool(pooler, prompts, score=True, use_tqdm=use_tqdm)
        return [relevance(out) for _, out in pooled]

    def _pooler(self, task: str) -> PoolerConfig:
        pooler = self.engine.pooler
        if pooler is None:
            raise ValueError("this model generates: load it with runner='pooling' to embed")
        if task == "classify" and pooler.task != "classify":
            raise ValueError("this model embeds: scoring needs a cross-encoder (*ForSequenceClassification)")
        if task == "embed" and pooler.task != "embed":
            raise ValueError("this model is a reranker: use score(), not embed()")
        return pooler

    def _pool(
        self, pooler: PoolerConfig, prompts: list[list[int]], score: bool, use_tqdm: bool
    ) -> list[tuple[list[int], PooledOutput]]:
        """Each prompt's pooled output, all submitted together (one request each)."""
        self._check_tp()
        results: list[PooledOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="pooling", disable=not use_tqdm)
        requests = []
        for i, ids in enumerate(prompts):
            state = PoolingState(pooler.pooling_type, score, self.engine.score_row,
                                 causal=not getattr(self.engine.model, "is_encoder", False))
            requests.append(Request(f"offline-{next(self._ids)}", ids, SamplingParams(max_tokens=0),
                                    sink=partial(self._pooled, results, i, bar), pooling=state))
        self._run_requests(requests, bar)
        for request, result in zip(requests, results):
            if result is None:
                raise RuntimeError(f"request {request.rid} ended without a result ({request.finish_reason})")
        return [(ids, cast(PooledOutput, out)) for ids, out in zip(prompts, results)]

    @staticmethod
    def _pooled(results: list[PooledOutput | None], index: int, bar: tqdm, event: RequestEvent) -> None:
        if event.pooled is not None:
            results[index] = event.pooled
            bar.update(1)

    def _prepare(
        self, prompts: Sequence[Prompt | MultiModalPrompt | _Encoded], sampling_params: Sequence[SamplingParams],
        bar: tqdm,
    ) -> tuple[list[GenerationOutput], list[Request]]:
        """Encode every prompt and build its request, submitting none (the
        scheduler's submit_all checks them: bad params, an impossible prompt);
        a grammar that does not compile raises here."""
        outputs, requests = [], []
        for prompt, params in zip(prompts, sampling_params):
            ids, images = self._with_images(prompt)
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            output = GenerationOutput(text if isinstance(text, str) else None, ids)
            rid = f"offline-{next(self._ids)}"
            stream = OutputStream(self.tokenizer, ids, params, end_request=partial(self.scheduler.abort, rid, "stop"))
            request = Request(rid, ids, params, sink=self._sink(stream, output, bar), grammar=self._grammar(params),
                              images=images)
            outputs.append(output)
            requests.append(request)
        return outputs, requests

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under `name` (AdapterError if it cannot be served)."""
        self.scheduler.load_adapter_now(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        if not self.scheduler.unload_adapter(name):
            raise ValueError(f"no LoRA adapter named `{name}` is loaded")

    def _adapter(self, choice: LoraChoice) -> Adapter | None:
        if choice is None:
            return None
        name = choice if isinstance(choice, str) else getattr(choice, "lora_name", None)
        if not isinstance(name, str):
            raise TypeError("lora_request: an adapter's name, or an object with lora_name and lora_path")
        adapter = self.scheduler.adapter(name)
        if adapter is None and not isinstance(choice, str):
            adapter = self.scheduler.load_adapter_now(name, str(getattr(choice, "lora_path")))
        if adapter is None:
            raise ValueError(f"no LoRA adapter named `{name}` is loaded")
        return adapter

    def _on_tp_failure(self, reason: str) -> None:
        """A rank died or a step failed (called from another thread): end the
        running generate, which then raises."""
        self.tp_failure = reason
        try:
            self._loop.call_soon_threadsafe(self._cancel_run)
        except RuntimeError:  # the loop is closed
            pass

    def _cancel_run(self) -> None:
        if self._run is not None:
            self._run.cancel()

    def _check_tp(self) -> None:
        if self.tp_failure is not None:
            raise RuntimeError(f"tensor parallelism failed: {self.tp_failure}; create a new LLM")

    def _grammar(self, params: SamplingParams):
        """The compiled grammar of a constrained request (GrammarError, a ValueError, if it does not compile)."""
        spec = params.structured_outputs
        if spec is None:
            return None
        spec.validate()  # before compiling: a remote $ref would compile to an unconstrained schema
        return compiler_for(self.tokenizer, self.engine.vocab_size).compile(spec)

    @staticmethod
    def _sink(stream: OutputStream, output: GenerationOutput, bar: tqdm) -> Callable[[RequestEvent], None]:
        def on_event(event: RequestEvent) -> None:
            if stream.finished:
                return
            stream.fold(event)
            if stream.finished:
                output.text = stream.text
                output.token_ids = stream.token_ids
                # Asked for or not at all: unasked, the sampler computes none (0 stands in).
                output.logprobs = stream.logprobs if stream.params.logprobs is not None else []
                output.top_logprobs = stream.top_logprobs
                output.prompt_logprobs = stream.prompt_logprobs
                output.finish_reason = stream.finish_reason
                output.num_cached_tokens = stream.num_cached_tokens
                bar.update(1)

        return on_event

    def chat(
        self, conversations: list[list[dict[str, Any]]], sampling_params: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        """Apply the chat template to each conversation, then generate. A
        vision-language model takes image parts (`image_url` with a URL or a
        data URL, `image_pil` with a PIL image)."""
        if self.images is None:
            return self.generate([self.tokenizer.encode_chat(c) for c in conversations], sampling_params)
        prompts = [_Encoded(*self.images.chat(c, self._encode_conversation)) for c in conversations]
        return self.generate(cast(Any, prompts), sampling_params)

    def _encode_conversation(self, messages: list[dict[str, Any]], rewrite: Callable[[str], str] | None) -> list[int]:
        return self.tokenizer.encode_chat(messages, rewrite=rewrite)

    @property
    def stats(self):
        return self.scheduler.stats

    def close(self) -> None:
        if self.images is not None:
            self.images.intake.shutdown()
        self.scheduler.shutdown()
        self.tokenizer.shutdown()
        self._loop.close()
