"""Batched sampling: logit adjustments, grammar masks, greedy or filtered
random choice, logprobs.

Random rows are sampled by inverting the CDF with one uniform draw per row,
and the scheduler chooses that draw (from the request's seed and how many
tokens it has produced). So a seeded request gets the same tokens whatever
else shares its batch, and every tensor-parallel rank samples the same token.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from aioserve.batch_plan import SamplingTensors
from aioserve.cpu.elementwise import elementwise_kernels


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]; 0 for a row whose logits are not finite
    logprobs: torch.Tensor  # [S] of the chosen tokens, from the raw model logits; NaN: see below
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
        # A masked logit (-inf: min_tokens' EOS, a -100 bias's floor) stays
        # masked: a penalty that is 0 in float32 (5e-324 is a positive float64)
        # would make it -inf * 0 = NaN, and the row unsampleable.
        scaled = torch.where(values > 0, values / penalty, values * penalty)
        out[rows, ids] = torch.where(values == float("-inf"), values, scaled)
    if st.output_rows.numel():
        # Static shapes, so no device sync (unique(return_counts=True) had to
        # wait for the GPU to learn its output's size) and no dense [S, V]
        # table (151k floats a row for Qwen). Frequency: an accumulating
        # scatter subtracts it once per occurrence. Presence: once per token,
        # by writing (value after frequency - presence) for every occurrence;
        # repeated (row, id) pairs write the same value.
        rows, ids = st.output_rows, st.output_token_ids
        out.index_put_((rows, ids), -st.frequency[rows], accumulate=True)
        out[rows, ids] = out[rows, ids] - st.presence[rows]
    # A penalty near 0 divides a logit into +inf; the largest float keeps it
    # first without making the row's softmax NaN. (-inf stays: it is a mask.)
    return out.clamp_(max=torch.finfo(out.dtype).max)


# Byte value -> its 8 bits as additive logit masks (0: allowed, -inf: not).
_BYTE_MASKS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_masks(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    table = _BYTE_MASKS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
        table = _BYTE_MASKS[(device, dtype)] = torch.where(bits.bool(), 0.0, float("-inf")).to(dtype)
    return table


def grammar_mask(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[G, W] int32 packed bitmask (bit t % 32 of word t // 32 allows token t)
    -> [G, vocab_size] additive mask: 0 where allowed, -inf elsewhere, and
    -inf past the mask's width (an embedding padded beyond the vocabulary).

    Each byte of the (little-endian) words is looked up in a 256 x 8 table:
    about 20x faster on CPU than shifting bits into a bool mask and applying
    it with where/masked_fill (1.5 ms against 33 ms for 16 x 152k logits)."""
    rows = bitmask.shape[0]
    table = _byte_masks(bitmask.device, dtype)
    mask = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).long(), table).reshape(rows, -1)
    if mask.shape[1] >= vocab_size:
        return mask[:, :vocab_size]
    return torch.nn.functional.pad(mask, (0, vocab_size - mask.shape[1]), value=float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The packed bitmask as [G, vocab_size] bool."""
    return grammar_mask(bitmask, vocab_size) == 0


def apply_grammar(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Disallowed tokens of constrained rows get -inf; a new tensor when any
    row is constrained, else `logits` itself."""
    if st.grammar_rows.numel() == 0:
        return logits
    mask = grammar_mask(st.grammar_bitmask, logits.shape[1], logits.dtype)
    return logits.index_add(0, st.grammar_rows, mask)


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, unnormalised,
    in vocab order.

    Top-k and top-p are decided on a sorted copy, but only as a keep-mask
    carried back to vocab order: every row is then sampled in vocab order, and
    a row that uses neither gets exactly the probabilities it would get in a
    batch that sorts nothing. (Sampling sorted rows in sorted order made a
    seeded request's tokens change when a top-p request joined its batch.)
    """
    temperatures = torch.where(st.temperatures > 0, st.temperatures, 1.0)
    # Shifted by the row's peak before the division, so that a large logit over
    # a small temperature cannot overflow to inf (softmax of inf is NaN).
    peak = logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax((logits - peak) / temperatures[:, None], dim=-1)
    if st.needs_sort:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[1], device=probs.device)
        in_top_k = ranks[None, :] < st.top_ks[:, None]
        top_k_probs = sorted_probs * in_top_k
        top_k_probs = top_k_probs / top_k_probs.sum(dim=-1, keepdim=True)
        # Keep a token while the mass ranked above it is still below top_p;
        # the top token always stays.
        mass_before = top_k_probs.cumsum(dim=-1) - top_k_probs
        keep_sorted = in_top_k & (mass_before < st.top_ps[:, None])
        keep_sorted[:, 0] = True  # even where top_p underflows float32 to 0
        filtering = (st.top_ks < probs.shape[1]) | (st.top_ps < 1.0)
        keep_sorted |= ~filtering[:, None]
        probs = probs * torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    if st.needs_min_p:
        peak = probs.max(dim=-1, keepdim=True).values
        probs = probs * (probs >= st.min_ps[:, None] * peak)
    return probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling in vocab order with one uniform draw per row."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total may round up to total in float32; stay strictly below it so the
    # chosen index always carries probability mass.
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """Choose one token per row of float32 `logits` [S, V] (greedy rows with
    no adjustment, `st.takes_raw_argmax`: the LM head's half outputs too).

    A row that cannot be sampled gets token 0 and logprob NaN, which no good
    row can have: its raw logits hold a NaN or an infinity (its request's
    numbers broke down), or its sampling left no token with probability (a
    penalty or bias overflowing to infinity, a grammar that allows nothing).
    The flag travels in the logprobs the host copies anyway, so finding it
    costs no extra device sync, and the token stays a valid id for the next
    step's placeholders. Every operation here works row by row, so the other
    rows sample exactly as they would without it."""
    kernels = elementwise_kernels() if logits.is_cpu and logits.dtype == torch.float32 else None
    if st.takes_raw_argmax:
        return _greedy(kernels, logits) if kernels is not None else _greedy_in_torch(logits)
    # The grammar mask comes after bias and penalties, so top-k, top-p and
    # min-p choose among the tokens the grammar allows.
    adjusted = apply_grammar(adjust_logits(logits, st), st)
    # One reduction over the raw logits is needed anyway; it also says whether
    # they are finite (a NaN or a +inf makes it NaN or inf; a -inf logit is
    # just a token that cannot be chosen). Without logprobs wanted, the max
    # does for it, at a fraction of logsumexp's cost.
    if kernels is not None and adjusted is logits and not st.wants_logprobs:
        # The max and the argmax of unadjusted logits in one native pass
        # (torch's CPU argmax alone took 4x the amax).
        normalizer, token_ids = kernels.row_max_argmax(logits)
        normalizer = normalizer[:, None]
    else:
        token_ids = adjusted.argmax(dim=-1)
        if st.wants_logprobs:
            normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
        else:
            normalizer = logits.amax(dim=-1, keepdim=True)
    # Greedy rows need a finite best choice (-inf everywhere: nothing allowed).
    usable = normalizer.squeeze(1).isfinite() & adjusted.gather(1, token_ids[:, None]).squeeze(1).isfinite()
    if not st.all_greedy:
        probs = filtered_probs(adjusted, st)
        sampled = sample_from(probs, st.uniforms)
        sampling = st.temperatures > 0
        token_ids = torch.where(sampling, sampled, token_ids)
        # Sampled rows need mass to sample from (a NaN total fails `> 0` too).
        mass = probs.sum(dim=-1)
        usable &= ~sampling | ((mass > 0) & mass.isfinite())
    token_ids = torch.where(usable, token_ids, 0)
    # Logprobs are reported from the model's raw distribution, like vLLM's
    # default; when no row wants them, 0 stands in (never reported).
    if st.wants_logprobs:
        chosen = (logits.gather(1, token_ids[:, None]) - normalizer).squeeze(1)
    else:
        chosen = torch.zeros_like(normalizer.squeeze(1))
    chosen = torch.where(usable, chosen, float("nan"))
    top_ids = top_logprobs = None
    if st.num_top_logprobs:
        top_values, top_ids = logits.topk(st.num_top_logprobs, dim=-1)
        top_logprobs = top_values - normalizer
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)


def _greedy(kernels: ModuleType, logits: torch.Tensor) -> SamplerOutput:
    """Greedy rows of unadjusted logits, no logprobs wanted: what sample()
    gives them in four ops instead of a dozen (a single-stream decode step's
    sampling on a CPU is mostly per-op overhead). The chosen logit is the
    row's max, so the max alone says whether the row was usable."""
    maxes, token_ids = kernels.row_max_argmax(logits)
    usable = maxes.isfinite()
    return SamplerOutput(
        token_ids.masked_fill_(~usable, 0), torch.where(usable, 0.0, float("nan")), None, None
    )


def _greedy_in_torch(logits: torch.Tensor) -> SamplerOutput:
    """`_greedy` in four torch ops (a GPU's kernels: sample() takes nine for
    these rows). `max(dim)` gives each row's max and its first index in one
    reduction (its index is argmax's, ties and all), and propagates NaN (a
    row holding one gets it), so the max is finite exactly when the row is
    usable: one check covers NaN, +inf and an all -inf row, as sample()'s
    two do. The flag's float32 logprobs come from scalars, whatever the
    logits' dtype (a GPU's greedy rows read the head's bf16 outputs)."""
    maxes, token_ids = logits.max(dim=-1)
    usable = maxes.isfinite()
    return SamplerOutput(torch.where(usable, token_ids, 0), torch.where(usable, 0.0, float("nan")), None, None)


def prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Each prompt position's logprob of the token that follows it, the
    `num_top` best at that position (ids, logprobs), from the raw logits,
    and the following token's rank there (1: the likeliest; vLLM reports it)."""
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    target = logits.gather(1, target_ids[:, None])
    chosen = (target - normalizer).squeeze(1)
    ranks = (logits > target).sum(dim=-1) + 1
    if not num_top:
        return chosen, None, None, ranks
    values, top_ids = logits.topk(num_top, dim=-1)
    return chosen, top_ids, values - normalizer, ranks
