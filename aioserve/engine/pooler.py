"""A pooling step's output: each segment's row (or sum of rows) of the
final hidden states, and the model's score head where the plan asks.

The host finishes the job (scheduler/pooling.py): a sum becomes a mean once
every chunk of a request has landed, and normalising and truncating the
vector are the server's. Here only what needs the device's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aioserve.batch_plan import PoolingRequest
from aioserve.config import ConfigError
from aioserve.pooling_config import PoolerConfig


def segment_rows(host: PoolingRequest, which: str) -> torch.Tensor:
    """Each segment's first or last row of the flat token batch (on the host)."""
    return host.starts if which == "first" else host.starts + host.lengths - 1


ScoreHead = Callable[[torch.Tensor], torch.Tensor]  # [N, hidden] rows -> [N, labels] float32 logits


class TokenPairScore:
    """A causal LM as a reranker (Qwen3-Reranker): its one logit is the
    `yes` token's logit less the `no` token's at the prompt's last row, whose
    sigmoid is softmax([no, yes])[yes], the model card's score."""

    def __init__(self, model: Any, no_id: int, yes_id: int) -> None:
        self.model, self.no_id, self.yes_id = model, no_id, yes_id

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(rows)  # the whole vocabulary: every TP rank takes part
        return (logits[:, self.yes_id] - logits[:, self.no_id]).unsqueeze(-1).float()


def classifier_token_ids(tokenizer_folder: Path, tokens: tuple[str, str]) -> tuple[int, int]:
    """The ids of classifier_from_token's two tokens, each one token of the vocabulary."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    ids = []
    for token in tokens:
        found = tokenizer.token_to_id(token)
        if found is None:
            encoded = tokenizer.encode(token, add_special_tokens=False).ids
            if len(encoded) != 1:
                raise ConfigError(f"classifier_from_token: {token!r} is not one token of this vocabulary ({encoded})")
            found = encoded[0]
        ids.append(found)
    return ids[0], ids[1]


def score_head_of(model: Any, pooler: PoolerConfig | None, tokenizer_folder: Path) -> tuple[ScoreHead | None, str]:
    """What scores a pooling model's pairs, and which row of a sequence it reads."""
    if pooler is None or pooler.task != "classify":
        return None, "last"
    if pooler.classifier_from_token is not None:
        no_id, yes_id = classifier_token_ids(tokenizer_folder, pooler.classifier_from_token)
        return TokenPairScore(model, no_id, yes_id), "last"
    head = getattr(model, "score_head", None)
    if head is None:
        raise ConfigError(f"{type(model).__name__} has no classifier: it cannot rerank (a causal LM scored by two "
                          'tokens takes --pooler-config \'{"classifier_from_token": ["no", "yes"]}\')')
    return head, getattr(model, "score_row", "last")


def pool_segments(
    hidden: torch.Tensor, host: PoolingRequest, score_head: ScoreHead | None, score_row: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([P, H] float32 pooled rows, [P, L] float32 score logits or None)."""
    device = hidden.device
    if host.pooling_type == "MEAN":
        count = host.starts.shape[0]
        segment = torch.repeat_interleave(torch.arange(count), host.lengths)
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(host.starts.tolist(), host.lengths.tolist())])
        pooled = torch.zeros(count, hidden.shape[-1], dtype=torch.float32, device=device)
        pooled.index_add_(0, segment.to(device), hidden[rows.to(device)].float())
    else:
        pooled = hidden[segment_rows(host, "first" if host.pooling_type == "CLS" else "last").to(device)].float()
    scores = None
    if host.score:
        if score_head is None:
            raise RuntimeError("this model has no score head: it cannot rerank or score")
        scores = score_head(hidden[segment_rows(host, score_row).to(device)]).float()
    return pooled, scores
