"""A pooling request's vector, gathered over its prompt's chunks.

The engine returns, per chunk, its last row, first row or the sum of its
rows (engine/pooler.py); a long prompt arrives in several chunks, so the
request keeps the running sum (MEAN), its first chunk's first row (CLS) or
its final chunk's last row (LAST), and the score head's logits from the
chunk holding the row the head reads. What a consumer gets, once the whole
prompt is computed, is `PooledOutput`: the raw float32 vector (normalising
and truncating are the server's: they depend on the request's `dimensions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PooledOutput:
    vector: torch.Tensor  # [H] float32: the pooled hidden state
    scores: list[float] | None  # the score head's logits (rerankers), else None


@dataclass
class PoolingState:
    pooling_type: str  # LAST | MEAN | CLS (pooling_config.POOLING_TYPES)
    score: bool = False  # also run the model's score head
    score_row: str = "last"  # which row of the sequence that head reads: first | last
    causal: bool = True  # a decoder's: a row's hidden state depends on the rows before it only
    _vector: torch.Tensor | None = None
    _scores: torch.Tensor | None = None
    _rows: int = 0

    @property
    def reuses_prefix(self) -> bool:
        """Only a causal model's last row matters: a cached prefix's rows need not be computed."""
        return self.causal and self.pooling_type == "LAST" and not (self.score and self.score_row == "first")

    def add(self, pooled: torch.Tensor, scores: torch.Tensor | None, rows: int, first: bool, last: bool) -> None:
        """One chunk's output: `rows` tokens, the prompt's first and/or last
        chunk. A first chunk starts over (a preempted request recomputes)."""
        if first:
            self._vector, self._scores, self._rows = None, None, 0
        self._rows += rows
        if self.pooling_type == "MEAN":
            self._vector = pooled if self._vector is None else self._vector + pooled
        elif (self.pooling_type == "CLS" and first) or (self.pooling_type == "LAST" and last):
            self._vector = pooled
        if scores is not None and (first if self.score_row == "first" else last):
            self._scores = scores

    def result(self) -> PooledOutput:
        assert self._vector is not None, "a pooling request finished before its chunks landed"
        vector = self._vector / self._rows if self.pooling_type == "MEAN" else self._vector
        return PooledOutput(vector, self._scores.tolist() if self._scores is not None else None)


def embedding_vector(pooled: PooledOutput, normalize: bool, dimensions: int | None = None) -> list[float]:
    """What a client gets: the first `dimensions` values (a Matryoshka
    model's shorter embedding), L2-normalised where the model normalises."""
    vector = pooled.vector if dimensions is None else pooled.vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()


def relevance(pooled: PooledOutput) -> float:
    """A reranker's score in [0, 1]: the sigmoid of its one logit, as
    sentence-transformers' CrossEncoder and vLLM's /rerank give it."""
    assert pooled.scores is not None, "a score request ended without its score"
    return float(torch.sigmoid(torch.tensor(pooled.scores[0])))
