"""Request bodies of the pooling routes: OpenAI's embeddings, the
Jina/Cohere rerank shape vLLM serves, and vLLM's score."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, StrictStr, field_validator

from aioserve.server.intake.request_model import RequestModel

# OpenAI's bound on one embeddings request's inputs (its API reference):
# also what keeps one request from queueing unbounded work.
MAX_INPUTS = 2048

Text = Annotated[StrictStr, Field(min_length=1)]  # OpenAI refuses an empty string
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
EmbeddingInput = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] | TokenIds | \
    Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
INPUT_SHAPES = "a non-empty string, a list of them, a list of token ids, or a list of such lists"


def _check_input_shape(value: Any) -> Any:
    """One clear message for a malformed `input` (the union's own lists every
    alternative it tried)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("input must not be an empty string")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"input must be {INPUT_SHAPES}")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"input holds {len(value)} items; at most {MAX_INPUTS} are taken in one request")
    kinds = {type(item) for item in value}
    if kinds == {str}:
        if not all(value):
            raise ValueError("input must not hold an empty string")
    elif kinds == {list}:
        if not all(item and all(type(t) is int for t in item) for item in value):
            raise ValueError("input's lists must be non-empty lists of token ids")
    elif kinds != {int}:
        raise ValueError(f"input must be {INPUT_SHAPES}, not a mix")
    return value


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput = Field(description=INPUT_SHAPES)

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        return _check_input_shape(value)

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="a Matryoshka model's shorter embedding")
    user: str | None = None
    # vLLM's: keep only the last N tokens of each input (otherwise a too-long input is a 400).
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class RerankDocument(RequestModel):
    text: Text


class RerankRequest(RequestModel):
    query: Text
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]
    model: str | None = None
    top_n: int | None = Field(None, ge=0, description="the best N results (0 or absent: all)")
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


ScoreText = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(RequestModel):
    text_1: ScoreText
    text_2: ScoreText
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)

    def pairs(self) -> list[tuple[str, str]]:
        """One to one, or one to many (vLLM's rule: text_1 a single text, or as many as text_2)."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2")
        return list(zip(first, second))
