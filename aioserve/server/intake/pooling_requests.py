"""Request bodies of the pooling routes: OpenAI's embeddings, the
Jina/Cohere rerank shape vLLM serves, and vLLM's score."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt, StrictStr

from aioserve.server.intake.request_model import RequestModel

# OpenAI's bound on one embeddings request's inputs (its API reference):
# also what keeps one request from queueing unbounded work.
MAX_INPUTS = 2048

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
EmbeddingInput = StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_INPUTS)] | TokenIds | \
    Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput = Field(description="a string, strings, token ids, or lists of token ids")
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="a Matryoshka model's shorter embedding")
    user: str | None = None
    # vLLM's: keep only the last N tokens of each input (otherwise a too-long input is a 400).
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class RerankDocument(RequestModel):
    text: StrictStr


class RerankRequest(RequestModel):
    query: StrictStr
    documents: Annotated[list[StrictStr | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]
    model: str | None = None
    top_n: int | None = Field(None, ge=0, description="the best N results (0 or absent: all)")
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


ScoreText = StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_INPUTS)]


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
