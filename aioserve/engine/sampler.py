"""Batched sampling: logit adjustments, greedy or filtered random choice, logprobs.

Random rows are sampled by inverting the CDF with one uniform draw per row,
and the scheduler chooses that draw (from the request's seed and how many
tokens it has produced). So a seeded request gets the same tokens whatever
else shares its batch, and every tensor-parallel rank samples the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aioserve.batch_plan import SamplingTensors


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    logprobs: torch.Tensor  # [S] of the chosen tokens, from the raw model logits
    top_ids: torch.Tensor | None  # [S, N]
    top_logprobs: torch.Tensor | None  # [S, N]


def adjust_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logit_bias (and min_tokens' -inf), then repetition, presence and
    frequency penalties. Returns a new tensor; `logits` is left untouched."""
    if st.bias_rows.numel() == 0 and not st.has_penalties:
        return logits
    out = logits.clone()
    if st.bias_rows.numel():
        out.index_put_((st.bias_rows, st.bias_token_ids), st.bias_values, accumulate=True)
    if st.seen_rows.numel():
        rows, ids = st.seen_rows, st.seen_token_ids
        values = out[rows, ids]
        penalty = st.repetition[rows]
        # Repeated (row, id) pairs write the same value, so duplicates are harmless.
        out[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
    if st.output_rows.numel():
        vocab = out.shape[1]
        pairs, counts = (st.output_rows * vocab + st.output_token_ids).unique(return_counts=True)
        rows, ids = pairs // vocab, pairs % vocab
        out[rows, ids] -= st.frequency[rows] * counts.to(out.dtype) + st.presence[rows]
    return out


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature, top-k, top-p and min-p, unnormalised.

    With top-k/top-p the rows come back sorted (descending) along with the
    order that maps a sorted position to its token id; otherwise in vocab order.
    """
    temperatures = torch.where(st.temperatures > 0, st.temperatures, 1.0)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    order = None
    if st.needs_sort:
        probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[1], device=probs.device)
        probs = probs * (ranks[None, :] < st.top_ks[:, None])
        probs = probs / probs.sum(dim=-1, keepdim=True)
        # Keep a token while the mass ranked above it is still below top_p;
        # the top token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs * (mass_before < st.top_ps[:, None])
    if st.needs_min_p:
        peak = probs.max(dim=-1, keepdim=True).values
        probs = probs * (probs >= st.min_ps[:, None] * peak)
    return probs, order


def sample_from(probs: torch.Tensor, order: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform draw per row."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total may round up to total in float32; stay strictly below it so the
    # chosen index always carries probability mass.
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return order.gather(1, index[:, None]).squeeze(1) if order is not None else index


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """Choose one token per row of float32 `logits` [S, V]."""
    adjusted = adjust_logits(logits, st)
    token_ids = adjusted.argmax(dim=-1)
    if not st.all_greedy:
        probs, order = filtered_probs(adjusted, st)
        sampled = sample_from(probs, order, st.uniforms)
        token_ids = torch.where(st.temperatures > 0, sampled, token_ids)
    # Logprobs are reported from the model's raw distribution, like vLLM's default.
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, token_ids[:, None]) - normalizer
    top_ids = top_logprobs = None
    if st.num_top_logprobs:
        top_values, top_ids = logits.topk(st.num_top_logprobs, dim=-1)
        top_logprobs = top_values - normalizer
    return SamplerOutput(token_ids, chosen.squeeze(1), top_ids, top_logprobs)
