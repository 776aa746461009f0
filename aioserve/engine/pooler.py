"""A pooling step's output: each segment's row (or sum of rows) of the
final hidden states, and the model's score head where the plan asks.

The host finishes the job (scheduler/pooling.py): a sum becomes a mean once
every chunk of a request has landed, and normalising and truncating the
vector are the server's. Here only what needs the device's tensors.
"""

from __future__ import annotations

import torch

from aioserve.batch_plan import PoolingRequest


def segment_rows(host: PoolingRequest, which: str) -> torch.Tensor:
    """Each segment's first or last row of the flat token batch (on the host)."""
    return host.starts if which == "first" else host.starts + host.lengths - 1


def pool_segments(model: object, hidden: torch.Tensor, host: PoolingRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        head = getattr(model, "score_head", None)
        if head is None:
            raise RuntimeError(f"{type(model).__name__} has no score head: it cannot rerank or score")
        scored = hidden[segment_rows(host, getattr(model, "score_row", "last")).to(device)]
        scores = head(scored).float()
    return pooled, scores
