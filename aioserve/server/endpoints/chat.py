"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from aioserve.image_inputs import PromptImages
from aioserve.scheduler.constraint import ConstraintFactory
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.image_parts import chat_image_refs, refuse_chat_images, with_images
from aioserve.server.intake.openai_requests import ChatCompletionRequest
from aioserve.server.intake.request_body import parse_body
from aioserve.server.intake.structured import compile_grammar, structured_request
from aioserve.server.output.assembly import ChoiceUpdate, respond
from aioserve.server.output.completion_bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    Usage,
    openai_finish_reason,
)
from aioserve.server.output.content import ContentDelta, ContentProcessor
from aioserve.server.output.generation import Choice, Generation, new_id
from aioserve.server.output.logprobs import chat_logprobs
from aioserve.server.output.prompt_logprobs import vllm_prompt_logprobs
from aioserve.server.output.thinking import after_reasoning, chat_template_kwargs, thinks_first
from aioserve.server.body.checks import text_chars
from aioserve.server.output.tools import ToolPlan, content_processors, plan_tools, template_messages
from aioserve.server.request_metrics import arrival_time
from aioserve.server.wire import WireModel
from aioserve.tokenizer import ChatTemplateError


# apply_chat_template's own arguments, which chat_template_kwargs must not
# override (tokenize=True would hand the template ids instead of text).
TEMPLATE_CALL_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


async def encode_messages(
    ctx: ServingContext, body: ChatCompletionRequest, tools: ToolPlan
) -> tuple[list[int], PromptImages | None]:
    """The rendered messages' ids and, with image parts (a vision-language
    model), their images: read and processed while the template renders,
    each placeholder the template wrote then expanded to its image's tokens."""
    refuse_chat_images(ctx, body.messages)
    refs = chat_image_refs(body.messages)
    ctx.check_prompt_chars(sum(m.kept_chars() for m in body.messages), "messages")
    handed = body.model_dump(include={"messages", "tools", "chat_template_kwargs"}, exclude_none=True)
    # An image's URL (a data URL's megabytes) is not handed to the template: its placeholder is.
    ctx.check_template_chars(text_chars(handed) - sum(len(ref.url) for ref in refs), "messages")
    template = ctx.tokenizer.hf.chat_template
    messages = template_messages(tools, [m.template_dict() for m in body.messages], template)
    # One dict, so that chat_template_kwargs may set add_generation_prompt too
    # (as vLLM lets it) instead of colliding with the field of that name.
    kwargs = {"add_generation_prompt": body.add_generation_prompt, **tools.template_kwargs()}
    if body.continue_final_message:
        kwargs["continue_final_message"] = True
    extra = chat_template_kwargs(ctx, body)
    if reserved := sorted(TEMPLATE_CALL_ARGUMENTS & extra.keys()):
        raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    kwargs.update(extra)

    # With images, the family may write each image's tokens into the text (Gemma 3).
    rewrite = ctx.images.family.rewrite_text if refs and ctx.images is not None else None

    async def encode() -> list[int]:
        try:
            return await ctx.tokenizer.encode_chat_async(messages, rewrite=rewrite, **kwargs)
        except ChatTemplateError as exc:
            blamed = "chat_template_kwargs" if exc.refused_arguments and extra else "messages"
            raise APIError(str(exc), param=blamed) from None

    return await with_images(
        ctx, encode, refs, "messages", "messages",
        "the model's chat template does not place these messages' images, or their text spells an image placeholder",
    )


async def create_chat_completion(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, ChatCompletionRequest)
    generation, new_processor = await start_chat(request, ctx, body, "chatcmpl")
    builder = ChatBuilder(ctx, body, generation.request_id)
    return await respond(
        request, generation, builder, stream=body.stream, include_usage=body.include_usage,
        new_processor=new_processor,
    )


async def start_chat(
    request: Request, ctx: ServingContext, body: ChatCompletionRequest, id_prefix: str
) -> tuple[Generation, Callable[[object], ContentProcessor]]:
    """Render, constrain and start a chat request (for /v1/chat/completions
    and /v1/responses): its Generation and each choice's content processor."""
    adapter = ctx.check_model(body.model)
    ctx.check_generates()
    ctx.check_capacity(body.n, request.scope)
    if body.top_logprobs and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    tools = plan_tools(ctx, body)
    constraint = structured_request(body)
    if tools.grammar is not None:
        if constraint is not None:
            raise APIError(f"tool_choice {tools.mode!r} forces the output; {constraint.param} cannot also", param=constraint.param)
        constraint = tools.grammar
    prompt_ids, images = await encode_messages(ctx, body, tools)
    compiled = await compile_grammar(ctx, constraint, request.scope)
    thinking = await thinks_first(ctx, body, prompt_ids)
    grammar: ConstraintFactory | None = compiled
    if compiled is not None and thinking:
        grammar = await after_reasoning(ctx, compiled)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(body.token_limit, logprobs, body.prompt_logprobs, ctx.generation_defaults)
    params.structured_outputs = constraint.spec if constraint else None
    if tools.keeps_special_tokens:  # the format's markers are special tokens (Mistral's [TOOL_CALLS])
        params.skip_special_tokens = False
    generation = Generation(ctx, new_id(id_prefix), arrival_time(request), incremental=body.stream)
    try:
        generation.start([prompt_ids], params, body.n, grammar, adapter, images=[images])
        ctx.admitted(request.scope)
    except APIError as exc:  # the prompt is the rendered messages
        if exc.param == "prompt":
            exc.param = "messages"
        raise
    return generation, content_processors(ctx, tools, thinking)


class ChatBuilder:
    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, request_id: str) -> None:
        self.ctx = ctx
        self.body = body
        self.request_id = request_id
        self.created = int(time.time())
        self._unopened: list[Choice] = []  # choices whose role chunk is not sent yet

    def opening(self, choices: list[Choice]) -> list[WireModel]:
        # Nothing yet: the role chunk waits for the first tokens (see `_role_chunks`).
        self._unopened = choices
        return []

    def _role_chunks(self) -> list[WireModel]:
        """The role first, in a chunk of its own, as OpenAI sends it; with echo,
        the final message's text in one of its own (as vLLM sends it). Sent
        with the first tokens, not at admission, as OpenAI and vLLM do: a
        client timing its first chunk then measures the time to the first token."""
        choices, self._unopened = self._unopened, []
        if not choices:
            return []
        role = ChatDelta(role="assistant", content="")
        first = [ChatChunkChoice(index=c.index, delta=role, logprobs=None, finish_reason=None) for c in choices]
        chunks: list[WireModel] = [self._chunk(first)]
        if echoed := self.body.echoed_text:
            echo = ChatDelta(content=echoed)
            chunks.append(self._chunk([
                ChatChunkChoice(index=c.index, delta=echo, logprobs=None, finish_reason=None) for c in choices
            ]))
        return chunks

    def chunk(self, updates: list[ChoiceUpdate]) -> list[WireModel]:
        opening = self._role_chunks()
        choices = []
        for update in updates:
            logprobs = self._logprobs(update) if update.output.token_ids else None
            delta = _delta(update.content, force_content=logprobs is not None)
            if delta.model_fields_set or update.finish_reason:
                choices.append(
                    ChatChunkChoice(
                        index=update.choice.index, delta=delta, logprobs=logprobs,
                        finish_reason=openai_finish_reason(update.finish_reason),
                        stop_reason=_stop_reason(update),
                    )
                )
        return opening + ([self._chunk(choices)] if choices else [])

    def usage_chunk(self, usage: Usage) -> list[WireModel]:
        return [self._chunk([], usage)]

    def whole(self, results: list[ChoiceUpdate], usage: Usage) -> BaseModel:
        choices = [
            ChatChoice(
                index=update.choice.index,
                message=_message(update.message, self.body.echoed_text),
                logprobs=self._logprobs(update),
                finish_reason=openai_finish_reason(update.finish_reason),
                stop_reason=_stop_reason(update),
            )
            for update in results
        ]
        prompt_logprobs = None
        if self.body.prompt_logprobs is not None and results:
            choice = results[0].choice  # every choice shares the prompt
            prompt_logprobs = vllm_prompt_logprobs(
                self.ctx.tokenizer, choice.prompt_ids, choice.stream, self.body.prompt_logprobs
            )
        return ChatCompletion(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=choices, usage=usage
        )

    def _logprobs(self, update: ChoiceUpdate) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        out = update.output
        return chat_logprobs(self.ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)


def _delta(content: ContentDelta, force_content: bool) -> ChatDelta:
    """Only what this step adds; a chunk that carries logprobs carries its
    content too, even when the text is held back (a partial character)."""
    fields: dict = {}
    if content.content or force_content:
        fields["content"] = content.content
    if content.reasoning_content:
        fields["reasoning_content"] = content.reasoning_content
    if content.tool_calls:
        fields["tool_calls"] = content.tool_calls
    return ChatDelta(**fields)


def _stop_reason(update: ChoiceUpdate) -> int | str | None:
    return update.choice.stream.stop_reason if update.finish_reason else None


def _message(message: ContentDelta, echoed: str = "") -> ChatMessage:
    # A whole message's calls carry no stream index.
    calls = [{k: v for k, v in call.items() if k != "index"} for call in message.tool_calls]
    content = echoed + message.content
    return ChatMessage(
        # OpenAI answers a message that is only tool calls with content null.
        content=content if content or not calls else None,
        reasoning_content=message.reasoning_content or None,
        tool_calls=calls or None,
    )
