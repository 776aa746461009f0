"""POST /generate: SGLang's native endpoint, served by the same response
path as the OpenAI ones (only the wire shapes differ).

Images (image_data, a vision-language model) are placed as SGLang places
them: SGLang inserts nothing, its processor pairs each image, in order,
with an occurrence of the model's image marker in the prompt (Qwen2.5-VL:
<|vision_start|><|image_pad|><|vision_end|>, what its chat template writes
for an image part). Here the text (or input_ids) must hold exactly one
marker per image; SGLang only warns at a mismatch and drops what is left
over, aioserve answers 400."""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from aioserve.image_inputs import PromptImages
from aioserve.output_stream import OutputStream, TopLogprobs
from aioserve.scheduler.adapters import Adapter
from aioserve.server.body.checks import prompt_count
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.generate_request import GenerateRequest, sglang_param
from aioserve.server.intake.image_parts import ImageRef, generate_image_refs, intake_for, with_images
from aioserve.server.intake.request_body import parse_body
from aioserve.server.intake.structured import compile_grammar
from aioserve.server.output.assembly import ChoiceUpdate, respond
from aioserve.server.output.completion_bodies import Usage
from aioserve.server.output.generate_bodies import FinishReason, GenerateBatch, GenerateOutput, LogprobEntry, MetaInfo
from aioserve.server.output.generation import Choice, Generation
from aioserve.server.request_metrics import arrival_time
from aioserve.server.wire import WireModel


async def _prompts(ctx: ServingContext, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the request was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError("give exactly one of text and input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise APIError("text must not be empty", param="text")
        return await ctx.encode_prompts(texts, "text"), not isinstance(body.text, str)
    ids = body.input_ids or []
    if not ids or any(isinstance(p, list) and not p for p in ids):  # token id 0 is not empty
        raise APIError("input_ids must not be empty", param="input_ids")
    if isinstance(ids[0], int):
        return [list(ids)], False
    return [list(p) for p in ids], True


async def _images(
    ctx: ServingContext, prompts: list[list[int]], refs: list[list[ImageRef]], prompt_field: str
) -> list[PromptImages | None]:
    """Each prompt's images loaded and its markers expanded (prompts in
    turn: a batch with images is rare, and one failure ends the request)."""
    images: list[PromptImages | None] = []
    for p, (prompt_ids, its_refs) in enumerate(zip(prompts, refs)):
        if not its_refs:
            images.append(None)
            continue

        async def ids(prompt_ids: list[int] = prompt_ids) -> list[int]:
            return prompt_ids

        param = prompt_field if len(prompts) == 1 else f"{prompt_field}.{p}"
        prompts[p], its_images = await with_images(
            ctx, ids, its_refs, "image_data", param, "the prompt must hold the model's image marker once per image "
            "of image_data",
        )
        images.append(its_images)
    return images


def _request_ids(body: GenerateRequest, num_prompts: int) -> list[str]:
    if body.rid is None:
        return [uuid.uuid4().hex for _ in range(num_prompts)]
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if len(rids) != num_prompts:
        raise APIError(f"rid has {len(rids)} ids for {num_prompts} prompts", param="rid")
    return rids


def _adapters(ctx: ServingContext, body: GenerateRequest, num_prompts: int) -> list[Adapter | None]:
    """SGLang's lora_path: the name of a loaded adapter, for every prompt or one per prompt."""
    if body.lora_path is None:
        return [None] * num_prompts
    if not ctx.scheduler.serves_adapters:
        raise APIError("lora_path names a LoRA adapter, and they are not served: start the server with --enable-lora",
                       param="lora_path")
    names = [body.lora_path] * num_prompts if isinstance(body.lora_path, str) else body.lora_path
    if len(names) != num_prompts:
        raise APIError(f"lora_path has {len(names)} adapters for {num_prompts} prompts", param="lora_path")
    return [ctx.check_model(name, "lora_path") for name in names]


async def generate(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, GenerateRequest)
    ctx.check_generates()
    prompts_given = body.text if body.text is not None else body.input_ids
    ctx.check_capacity(prompt_count(prompts_given or "") * body.sampling_params.n, request.scope)
    prompt_field = "text" if body.text is not None else "input_ids"
    batch_given = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
    refs = generate_image_refs(body.image_data, prompt_count(prompts_given or ""), batch_given)
    for its_refs in refs:  # a text-only model, or too many images: refused before any tokenizing
        if its_refs:
            intake_for(ctx, its_refs, "image_data")
    prompts, batch = await _prompts(ctx, body)
    images = await _images(ctx, prompts, refs, prompt_field)
    rids = _request_ids(body, len(prompts))
    adapters = _adapters(ctx, body, len(prompts))
    n = body.sampling_params.n
    grammar = await compile_grammar(ctx, body.sampling_params.structured(), request.scope)
    generation = Generation(ctx, f"generate-{rids[0]}", arrival_time(request), incremental=body.stream)
    try:
        generation.start(prompts, body.to_sampling_params(ctx.generation_defaults), n, grammar, adapters, images)
        ctx.admitted(request.scope)
    except APIError as exc:  # named as OpenAI's fields are; say SGLang's names
        exc.param = sglang_param(exc.param, prompt_field)
        raise
    builder = GenerateBuilder(ctx, body, rids, several=batch or n > 1)
    return await respond(request, generation, builder, stream=body.stream)


class GenerateBuilder:
    """Each stream event is one output so far (text and ids cumulative); a
    whole response is one object, or a list for a batch or n > 1."""

    def __init__(self, ctx: ServingContext, body: GenerateRequest, rids: list[str], several: bool) -> None:
        self.ctx = ctx
        self.body = body
        self.rids = rids
        self.several = several
        self.started = time.monotonic()

    def opening(self, choices: list[Choice]) -> list[WireModel]:
        return []

    def chunk(self, updates: list[ChoiceUpdate]) -> list[WireModel]:
        return [self._output(update, index=update.choice.index if self.several else None) for update in updates]

    def usage_chunk(self, usage: Usage) -> list[WireModel]:
        return []  # SGLang's outputs carry their own counts

    def whole(self, results: list[ChoiceUpdate], usage: Usage) -> BaseModel:
        outputs = [self._output(update) for update in results]
        return GenerateBatch(outputs) if self.several else outputs[0]

    def _rid(self, choice: Choice) -> str:
        n = self.body.sampling_params.n
        rid = self.rids[choice.prompt_index]
        return rid if n == 1 else f"{rid}-{choice.index % n}"

    def _output(self, update: ChoiceUpdate, index: int | None = None) -> GenerateOutput:
        stream = update.choice.stream
        meta = MetaInfo(
            id=self._rid(update.choice),
            finish_reason=_finish_reason(stream, update.finish_reason),
            prompt_tokens=len(stream.prompt_ids),
            completion_tokens=len(stream.token_ids),
            cached_tokens=stream.num_cached_tokens,
            e2e_latency=time.monotonic() - self.started,
        )
        if self.body.return_logprob:
            self._add_logprobs(meta, stream)
        if stream.speculation is not None and stream.speculation.steps:
            spec = stream.speculation
            meta.spec_verify_ct, meta.spec_accept_length = spec.steps, len(stream.token_ids) / spec.steps
            meta.spec_num_proposed_drafts, meta.spec_num_correct_drafts = spec.proposed, spec.accepted
        return GenerateOutput(text=update.message.content, output_ids=stream.token_ids, meta_info=meta, index=index)

    def _add_logprobs(self, meta: MetaInfo, stream: OutputStream) -> None:
        tops = self.body.top_logprobs_num > 0
        meta.output_token_logprobs = [self._entry(lp, t) for lp, t in zip(stream.logprobs, stream.token_ids)]
        if tops:
            meta.output_top_logprobs = [self._top(top) for top in stream.top_logprobs]
        if self.body.wants_prompt_logprobs:
            start = self.body.logprob_start_len
            entries = (stream.prompt_logprobs or [])[start:]
            prompt_ids = stream.prompt_ids[start:]
            meta.input_token_logprobs = [self._entry(e[0] if e else None, t) for e, t in zip(entries, prompt_ids)]
            if tops:
                meta.input_top_logprobs = [self._top(e[1] if e else None) for e in entries]

    def _entry(self, logprob: float | None, token_id: int) -> LogprobEntry:
        text = self.ctx.tokenizer.token_text(token_id) if self.body.return_text_in_logprobs else None
        return (logprob, token_id, text)

    def _top(self, top: TopLogprobs | None) -> list[LogprobEntry] | None:
        return None if top is None else [self._entry(lp, t) for t, lp in top]


def _finish_reason(stream: OutputStream, reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    if reason == "length":
        return FinishReason(type="length", length=len(stream.token_ids))
    if reason in ("abort", "error"):
        return FinishReason(type="abort", message=stream.error or "the request was aborted")
    return FinishReason(type=reason, matched=stream.matched_stop if reason == "stop" else None)
