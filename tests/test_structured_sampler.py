"""The grammar mask in the sampler: the packed bitmask means what xgrammar
means by it, masked rows only ever choose allowed tokens (greedy or random,
with top-k/top-p), and rows without a mask are left exactly as they were."""

from __future__ import annotations

import torch
import xgrammar as xgr

from aioserve.engine.sampler import allowed_tokens, sample
from test_sampler import tensors

VOCAB = 1000


def random_bitmask(rows: int, vocab: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=generator) < density
    allowed[:, 0] |= ~allowed.any(dim=1)  # never an empty row
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    bits = padded.reshape(rows, words, 32).long() << torch.arange(32)
    packed = bits.sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, allowed


def test_unpacking_agrees_with_xgrammar() -> None:
    packed, allowed = random_bitmask(5, VOCAB, 0.3, seed=1)
    assert torch.equal(allowed_tokens(packed, VOCAB), allowed)
    logits = torch.randn(5, VOCAB)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, packed)
    ours = torch.where(allowed_tokens(packed, VOCAB), logits, float("-inf"))
    assert torch.equal(ours, theirs)
    # Tokens past the mask's width (an embedding padded beyond the vocabulary) are never allowed.
    assert not allowed_tokens(packed, VOCAB + 40)[:, VOCAB:].any()


def test_masked_rows_choose_allowed_tokens_and_free_rows_are_untouched() -> None:
    rows = 64
    logits = torch.randn(rows, VOCAB) * 3
    constrained = torch.arange(0, rows, 2)
    packed, allowed = random_bitmask(len(constrained), VOCAB, 0.02, seed=2)
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (1.3, 50, 0.9)):
        st = tensors(rows, temperature, top_k, top_p, grammar_rows=constrained, grammar_bitmask=packed)
        free = tensors(rows, temperature, top_k, top_p, uniforms=st.uniforms)
        masked_out, free_out = sample(logits, st), sample(logits, free)
        chosen = masked_out.token_ids[constrained]
        assert allowed[torch.arange(len(constrained)), chosen].all(), "a masked-out token was chosen"
        others = torch.arange(1, rows, 2)
        assert torch.equal(masked_out.token_ids[others], free_out.token_ids[others])
        # Logprobs stay those of the model's raw distribution.
        assert torch.allclose(masked_out.logprobs[others], free_out.logprobs[others])
        raw = torch.log_softmax(logits, dim=-1)[constrained, chosen]
        assert torch.allclose(masked_out.logprobs[constrained], raw)
