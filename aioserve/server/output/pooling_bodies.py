"""Response bodies of the pooling routes (embeddings, rerank, score)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from aioserve.server.wire import WireModel


class Embedding(WireModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(WireModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(WireModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankedDocument(WireModel):
    text: str


class RerankResult(WireModel):
    omit_when_none = ("document",)
    index: int
    relevance_score: float
    document: RerankedDocument | None = None


class RerankUsage(WireModel):
    total_tokens: int


class RerankResponse(WireModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreData(WireModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(WireModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
