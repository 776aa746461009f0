"""The sampler draws from the distribution its settings define, and a seed
fixes a request's tokens whatever shares its batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from aioserve import LLM, SamplingParams
from aioserve.batch_plan import SamplingTensors
from aioserve.engine.sampler import adjust_logits, sample

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -2.0])
VOCAB = LOGITS.numel()
DRAWS = 40_000


def tensors(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
            uniforms: torch.Tensor | None = None, **extra) -> SamplingTensors:
    empty = torch.zeros(0, dtype=torch.long)
    fields = dict(
        temperatures=torch.full((rows,), temperature),
        top_ks=torch.full((rows,), top_k if top_k > 0 else VOCAB, dtype=torch.long),
        top_ps=torch.full((rows,), top_p),
        min_ps=torch.full((rows,), min_p),
        uniforms=uniforms if uniforms is not None else torch.rand(rows, dtype=torch.float64),
        all_greedy=temperature == 0,
        needs_sort=top_k > 0 or top_p < 1,
        needs_min_p=min_p > 0,
        num_top_logprobs=0,
        wants_logprobs=True,
        bias_rows=empty, bias_token_ids=empty, bias_values=torch.zeros(0),
        presence=torch.zeros(rows), frequency=torch.zeros(rows), repetition=torch.ones(rows),
        output_rows=empty, output_token_ids=empty, seen_rows=empty, seen_token_ids=empty,
    )
    fields.update(extra)
    return SamplingTensors(**fields)


def reference_distribution(temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straight from the definitions: temperature, then top-k, then top-p over
    what is left (renormalised), then min-p relative to the most likely."""
    probs = np.exp(LOGITS.double().numpy() / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros(VOCAB, dtype=bool)
    keep[order[: top_k or VOCAB]] = True
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    mass = 0.0
    for token in order:
        if not keep[token]:
            continue
        if mass >= top_p:
            keep[token] = False
        mass += kept[token]
    keep &= probs >= min_p * probs.max()
    final = np.where(keep, probs, 0.0)
    return final / final.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.7, 0.0),
     (1.4, 0, 1.0, 0.15), (0.8, 5, 0.9, 0.05)],
)
def test_sampling_follows_the_filtered_distribution(temperature, top_k, top_p, min_p) -> None:
    torch.manual_seed(0)
    st = tensors(DRAWS, temperature, top_k, top_p, min_p)
    tokens = sample(LOGITS.repeat(DRAWS, 1), st).token_ids
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    expected = reference_distribution(temperature, top_k, top_p, min_p)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    _, p_value = chisquare(counts[support], expected[support] * DRAWS)
    assert p_value > 1e-3


def test_greedy_rows_take_the_argmax_and_logprobs_are_raw() -> None:
    st = tensors(3, temperature=0.0)
    st.num_top_logprobs = 2
    out = sample(LOGITS.repeat(3, 1), st)
    assert out.token_ids.tolist() == [0, 0, 0]
    raw = torch.log_softmax(LOGITS, -1)
    assert torch.allclose(out.logprobs, raw[0].repeat(3))
    assert out.top_ids[0].tolist() == [0, 1] and torch.allclose(out.top_logprobs[0], raw[:2])


def test_penalties_and_bias_follow_their_definitions() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    st = tensors(
        1,
        presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]), repetition=torch.tensor([2.0]),
        output_rows=torch.tensor([0, 0, 0]), output_token_ids=torch.tensor([0, 0, 2]),
        seen_rows=torch.tensor([0, 0, 0]), seen_token_ids=torch.tensor([0, 1, 2]),
        bias_rows=torch.tensor([0]), bias_token_ids=torch.tensor([3]), bias_values=torch.tensor([1.5]),
    )
    adjusted = adjust_logits(logits, st)[0].tolist()
    # token 0: seen (1.0 / 2), twice in output (-0.5 - 2 * 0.25); token 1: seen (-1 * 2);
    # token 2: seen (2 / 2), once in output (-0.5 - 0.25); token 3: bias only.
    assert adjusted == pytest.approx([0.5 - 1.0, -2.0, 1.0 - 0.75, 2.0])
    assert logits.tolist() == [[1.0, -1.0, 2.0, 0.5]], "the raw logits must stay untouched"


def test_a_masked_token_stays_masked_under_a_vanishing_repetition_penalty() -> None:
    """min_tokens' -inf on a seen EOS, and repetition_penalty 5e-324 (a
    positive float64, 0 in float32): -inf * 0 was NaN and the row failed
    (a 500, found by tests/test_fuzz.py). The row samples; EOS stays out."""
    logits = torch.tensor([[1.0, -1.0, 0.0, 0.5]])
    st = tensors(
        1, repetition=torch.tensor([5e-324]), seen_rows=torch.tensor([0, 0, 0]), seen_token_ids=torch.tensor([0, 1, 3]),
        bias_rows=torch.tensor([0]), bias_token_ids=torch.tensor([3]), bias_values=torch.tensor([float("-inf")]),
    )
    adjusted = adjust_logits(logits, st)[0]
    assert adjusted[3] == float("-inf") and not adjusted.isnan().any()
    out = sample(logits, st)
    assert out.token_ids.tolist() == [0] and not out.logprobs.isnan().any()


def test_seed_fixes_tokens_across_batch_compositions(llama_path: Path) -> None:
    llm = LLM(str(llama_path), page_size=4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    others = SamplingParams(max_tokens=24, temperature=1.2, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded)[0].token_ids
    crowd = llm.generate(
        ["The quick brown fox", "Once upon a time", "every morning the robot", "a"],
        [others, seeded, others, SamplingParams(max_tokens=5, temperature=0)],
    )[1].token_ids
    behind = llm.generate(["x" * 50, "Once upon a time"], [others, seeded])[1].token_ids
    assert alone == crowd == behind
    other_seed = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone
    llm.close()


def test_logit_bias_and_min_tokens_steer_generation(llama_path: Path) -> None:
    llm = LLM(str(llama_path), page_size=4)
    eos = llm.engine.model_config.eos_token_ids[0]
    forced = llm.generate("hi", SamplingParams(max_tokens=6, temperature=0, logit_bias={42: 100.0}, ignore_eos=True))[0]
    assert forced.token_ids == [42] * 6
    # EOS is pushed to the top, but min_tokens holds it off for 4 tokens.
    held = llm.generate("hi", SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0}, min_tokens=4))[0]
    assert held.token_ids[-1] == eos and len(held.token_ids) == 5 and held.finish_reason == "stop"
    assert eos not in held.token_ids[:4]
    llm.close()


def test_penalties_change_a_repetitive_greedy_output(tiny_checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(tiny_checkpoints["qwen3"]), page_size=4)
    plain = llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    penalised = llm.generate(
        "Once upon a time", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    )[0]
    assert penalised.token_ids != plain.token_ids
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))
    llm.close()


def test_a_row_samples_the_same_token_whether_or_not_its_batch_sorts() -> None:
    """A plain temperature row draws the same token alone and beside a top-p
    row (whose presence makes the batch sort); it used to be drawn in the
    sorted order then, so a seeded request changed with its neighbours."""
    uniforms = torch.rand(200, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    logits = LOGITS.repeat(2, 1)
    for u in uniforms:
        alone = sample(LOGITS[None], tensors(1, uniforms=u[None])).token_ids.item()
        pair = tensors(2, uniforms=torch.stack([u, u]), top_ps=torch.tensor([1.0, 0.5]), needs_sort=True)
        assert sample(logits, pair).token_ids[0].item() == alone
        # And the top-p row itself does not depend on which rows share its batch.
        with_top_p = tensors(1, top_p=0.5, uniforms=u[None])
        assert sample(LOGITS[None], with_top_p).token_ids.item() == sample(logits, pair).token_ids[1].item()


def test_without_logprobs_wanted_none_are_computed_but_bad_rows_are_still_flagged() -> None:
    logits = torch.stack([LOGITS, LOGITS, LOGITS.clone().index_fill_(0, torch.tensor([3]), float("nan"))])
    logits[1, 5] = float("inf")
    out = sample(logits, tensors(3, temperature=0, wants_logprobs=False))
    assert out.token_ids.tolist() == [0, 0, 0]  # the good row's argmax; the bad rows get the stand-in 0
    assert out.logprobs[0].item() == 0.0  # not computed: never reported
    assert torch.isnan(out.logprobs[1:]).all()  # +inf and NaN logits both flag their row


def test_the_torch_greedy_path_flags_what_the_general_path_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw-argmax rows without the CPU's native kernels (a GPU's path) take
    four torch ops, not sample()'s general nine; they give the same tokens
    and flags: NaN, +inf and an all -inf row unusable, the rest their argmax."""
    from aioserve.cpu import elementwise

    monkeypatch.setattr(elementwise, "ENABLED", False)
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.clone(), LOGITS.clone(), torch.full((VOCAB,), -float("inf"))])
    logits[2, 3], logits[3, 5] = float("nan"), float("inf")
    raw = tensors(5, temperature=0, wants_logprobs=False)
    assert raw.takes_raw_argmax
    zero = torch.zeros(1)
    general = tensors(5, temperature=0, wants_logprobs=False, bias_rows=torch.tensor([0]),
                      bias_token_ids=torch.tensor([0]), bias_values=zero)  # a bias of 0: the general path
    assert not general.takes_raw_argmax
    fast, slow = sample(logits, raw), sample(logits, general)
    assert fast.token_ids.tolist() == slow.token_ids.tolist() == [0, VOCAB - 1, 0, 0, 0]
    assert torch.equal(fast.logprobs.isnan(), slow.logprobs.isnan())
    assert fast.logprobs.isnan().tolist() == [False, False, True, True, True]


def test_the_same_flags_from_half_logits() -> None:
    """Greedy rows on a GPU read the LM head's bf16 outputs (no float32
    copy): the same tokens and flags as from their exact float32 copy."""
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.clone(), torch.full((VOCAB,), -float("inf"))])
    logits[2, 3] = float("nan")
    half = logits.to(torch.bfloat16)
    raw = tensors(4, temperature=0, wants_logprobs=False)
    from_half, from_copy = sample(half, raw), sample(half.float(), raw)
    assert from_half.token_ids.tolist() == from_copy.token_ids.tolist()
    assert from_half.logprobs.dtype == torch.float32
    assert torch.equal(from_half.logprobs.isnan(), from_copy.logprobs.isnan())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_from_the_heads_own_outputs_equals_the_float32_logits(tiny_checkpoints: dict[str, Path], arch: str) -> None:
    """The engine's GPU choice (`greedy_reads_head_dtype`) taken on a CPU
    bf16 model, its native head paths off (torch's matmul writes the head's
    bf16 outputs, as on a GPU): the same tokens, and rows that want
    logprobs still get them from float32 logits."""
    prompts = [[1, 5, 9, 13], [1, 2], [1, 7, 7, 7, 7, 7]]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1),  # its steps: float32
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    results = []
    for reads_head_dtype in (False, True):
        llm = LLM(str(tiny_checkpoints[arch]), dtype="bfloat16", cpu_half_compute="native", cpu_matmul="blas",
                  page_size=4)
        head_dtypes: list[torch.dtype] = []
        model = llm.engine.model
        original = model.head_outputs
        model.head_outputs = lambda hidden: head_dtypes.append((out := original(hidden)).dtype) or out
        try:
            llm.engine.greedy_screen = None
            llm.engine.greedy_reads_head_dtype = reads_head_dtype
            results.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)])
        finally:
            llm.close()
        # Only steps whose every row is greedy without logprobs read the head's outputs.
        assert set(head_dtypes) == ({torch.bfloat16} if reads_head_dtype else set())
    assert results[0] == results[1]
