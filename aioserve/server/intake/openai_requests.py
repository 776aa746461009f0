"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Unknown fields are ignored, as OpenAI's own server does; fields we cannot
honour (best_of > n, suffix, audio) are refused with a clear 400. Image
parts are read here whatever the model; a text-only model refuses them
when the request is served (server/intake/image_parts.py). The
structured-output fields (response_format, vLLM's structured_outputs and its
older guided_*) are read by structured.py, tools by server/output/tools.py.
An explicit null means the field's default, as in OpenAI's spec (clients and
SDKs send `"n": null` and the like). The ranges are OpenAI's
(aioserve/sampling_limits.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from aioserve.sampling_limits import OPENAI_BOUNDS
from aioserve.sampling_params import SamplingParams
from aioserve.server.errors import APIError
from aioserve.server.intake.generation_defaults import or_default
from aioserve.server.intake.request_model import RequestModel, bounded, check_logit_bias_keys
from aioserve.server.intake.unhonoured_fields import OPENAI_FIELDS


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs` extra body field (one of these is set)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(RequestModel):
    """Fields completions and chat share."""

    unhonoured = OPENAI_FIELDS

    model: str | None = None
    temperature: float | None = bounded(None, OPENAI_BOUNDS["temperature"])
    top_p: float | None = bounded(None, OPENAI_BOUNDS["top_p"])
    top_k: int | None = bounded(None, OPENAI_BOUNDS["top_k"])
    min_p: float | None = bounded(None, OPENAI_BOUNDS["min_p"])
    # Strict where OpenAI is: "3" is not a number, "yes" not a boolean (400, not coerced).
    n: StrictInt = bounded(1, OPENAI_BOUNDS["n"])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = bounded(0.0, OPENAI_BOUNDS["presence_penalty"])
    frequency_penalty: float = bounded(0.0, OPENAI_BOUNDS["frequency_penalty"])
    repetition_penalty: float = bounded(1.0, OPENAI_BOUNDS["repetition_penalty"])
    min_tokens: int = bounded(0, OPENAI_BOUNDS["min_tokens"])
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: the N likeliest tokens at each prompt position, with the prompt token's own logprob and rank.
    prompt_logprobs: StrictInt | None = bounded(None, OPENAI_BOUNDS["prompt_logprobs"])
    # Constrained decoding (server/intake/structured.py turns these into StructuredOutputParams).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM before 0.12; clients still send them
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_whole_only(self) -> SamplingFields:
        # As vLLM: the prompt's logprobs come with a whole response, not a stream.
        if self.stream and self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        # How many: --max-stop-sequences, checked before validation (server/body/checks.py).
        return [value] if isinstance(value, str) else list(value or [])

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias_keys(value)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """`defaults`: what the unset sampling fields take instead of the
        neutral values (the model's generation config, server/intake/generation_defaults.py)."""
        top_k = or_default(self, "top_k", defaults, -1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=or_default(self, "temperature", defaults, 1.0),
            top_p=or_default(self, "top_p", defaults, 1.0),
            top_k=-1 if top_k == 0 else top_k,
            min_p=or_default(self, "min_p", defaults, 0.0),
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=or_default(self, "repetition_penalty", defaults, 1.0),
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


# Strict members, tried in order: `[true, true]` is not token ids, nor "3" a
# number (OpenAI answers both 400), and a long list of ids is validated by its
# first member alone (the default "smart" union took 8x as long: 0.3 s for a
# million ids on the loop).
PromptField = Annotated[
    list[StrictInt] | StrictStr | list[StrictStr] | list[list[StrictInt]], Field(union_mode="left_to_right")
]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: StrictInt = Field(16, ge=0)  # 0: score the prompt (with echo and logprobs), generate nothing
    logprobs: StrictInt | None = bounded(None, OPENAI_BOUNDS["logprobs"])
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str
    # OpenAI's resolution hint; the model's own processor decides an
    # image's size here (as in vLLM), so it is taken and not used.
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL | str  # vLLM takes the URL alone too

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(RequestModel):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: an earlier turn's reasoning

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_images(cls, value: Any) -> Any:
        """Audio and files get one clear answer rather than pydantic's
        account of why each union member failed."""
        for number, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("text", "image_url"):
                raise ValueError(
                    f"content part {number} has type {kind!r}: this server takes 'text' parts, and 'image_url' "
                    "parts for a vision-language model"
                )
        return value

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message with role 'tool' must have a tool_call_id (the call it answers)")
        return self

    @model_validator(mode="after")
    def _images_from_the_user(self) -> ChatMessage:
        # As OpenAI: image parts are the user's (a template places them in user turns).
        if self.role != "user" and self.image_parts:
            raise ValueError(f"image parts are taken in user messages only, not in a {self.role!r} message")
        return self

    @property
    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """(part number, part) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(number, part) for number, part in enumerate(self.content) if isinstance(part, ImagePart)]

    @property
    def text(self) -> str:
        """The content's text: its text parts joined by newlines."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def kept_chars(self) -> int:
        """Characters of content every chat template writes out whole: a
        system, user or tool message's. (Templates may cut an assistant turn:
        Qwen3's drops earlier thinking.) For the prompt-length bound."""
        if self.role == "assistant":
            return 0
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content if isinstance(part, TextPart))
        return len(self.content or "")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: content a string, or with
        images a list of text parts and `{"type": "image"}` entries in order
        (where the template writes its image placeholder)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if self.image_parts:
            assert isinstance(self.content, list)
            message["content"] = [
                {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
                for part in self.content
            ]
        else:
            message["content"] = self.text
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    """Templates expect arguments as a mapping (they write `arguments | tojson`);
    a JSON string that is not an object stays a string."""
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        entry["id"] = call.id
    return entry


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = bounded(None, OPENAI_BOUNDS["logprobs"])
    add_generation_prompt: bool = True
    # vLLM's: the final (assistant) message is left open and the output continues it.
    continue_final_message: StrictBool = False
    # vLLM's: the output's content begins with the final message's, when that is the assistant's.
    echo: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _continue_or_open(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false to continue the final message)",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs the final message to be the assistant's", param="messages")
        return self

    @property
    def echoed_text(self) -> str:
        """What `echo` puts before the output: the final message's text when it is the assistant's."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return last.text

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # rendered by the chat template, as in a chat request
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # As a chat request takes them: the count matches the chat request's prompt.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
