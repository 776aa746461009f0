"""Speculative decoding (scheduler/speculation.py): verified drafts give the
outputs plain decoding gives, token for token with their logprobs, greedy
and seeded alike, whatever the proposals; rejected positions give their
pages back; the flags of vLLM and SGLang both turn it on."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from aioserve import LLM, SamplingParams
from aioserve.config import ConfigError, EngineConfig
from aioserve.scheduler.request import Request
from aioserve.speculative_config import SpeculativeConfig, resolve_speculative
from hf_reference import hf_encode

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts that quote themselves, so prompt lookup finds something to propose.
TEXTS = [
    "1 2 3 4 5 6 7 1 2 3 4 5 6 7 1 2 3",
    "the cat sat on the mat and the cat sat on the",
    "Once upon a time",
    "a b c a b c a b",
]


def same_outputs(a: list, b: list) -> bool:
    """Tokens and finish reasons equal; logprobs equal to float32 rounding (a
    position computed in a verification's extend rounds its last bits
    differently from one computed as a decode)."""
    return len(a) == len(b) and all(
        x[0] == y[0] and x[2] == y[2] and x[1] == pytest.approx(y[1], abs=1e-4) for x, y in zip(a, b)
    )


def _run(model: Path, prompts: list[list[int]], params: list[SamplingParams], **options) -> tuple[list, LLM]:
    llm = LLM(str(model), debug_integrity=True, **{"page_size": 4, **options})
    try:
        outs = llm.generate(prompts, params)
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.allocator.num_free + llm.scheduler.kv.cache.num_pages == llm.scheduler.kv.num_usable_pages
    finally:
        llm.close()
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs], llm


class OracleProposer:
    """Proposes what the plain run produced, with every `corrupt`-th
    proposal's token changed: acceptance from full to none, at will."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], corrupt: int, seed: int = 0) -> None:
        self.expected, self.corrupt, self.rng, self.calls = expected, corrupt, random.Random(seed), 0

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        self.calls += 1
        full = self.expected[tuple(request.prompt_ids)]
        done = request.num_output_tokens
        draft = list(full[done : done + num_tokens])  # row 0 samples output token `done`
        if draft and self.corrupt and self.calls % self.corrupt == 0:
            draft[self.rng.randrange(len(draft))] = self.rng.randrange(100)
        return draft


def _params(kind: str) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    if kind == "seeded":
        return SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True, logprobs=1)
    # penalties, a bias and min_tokens: each position's settings count the proposed tokens before it
    return SamplingParams(
        max_tokens=24, temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, logit_bias={5: 2.0}, min_tokens=20, logprobs=0,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalised"])
def test_ngram_outputs_equal_plain_decoding(tiny_checkpoints: dict[str, Path], arch: str, kind: str) -> None:
    model = tiny_checkpoints[arch]
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params(kind)] * len(prompts)
    plain, _ = _run(model, prompts, params)
    speculative, llm = _run(model, prompts, params, speculative_config=NGRAM)
    assert same_outputs(speculative, plain)
    stats = llm.scheduler.speculator.stats
    assert stats.drafts > 0 and stats.draft_tokens >= stats.accepted_tokens


@pytest.mark.parametrize("corrupt", [0, 1, 3])  # every proposal right; every one wrong; one in three wrong
@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalised"])
def test_any_proposal_gives_the_plain_outputs(tiny_checkpoints: dict[str, Path], corrupt: int, kind: str) -> None:
    model = tiny_checkpoints["qwen3"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params(kind)] * len(prompts)
    plain, _ = _run(model, prompts, params)
    expected = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=NGRAM)
    try:
        llm.scheduler.speculator.proposer = OracleProposer(expected, corrupt)
        outs = llm.generate(prompts, params)
        llm.scheduler.check_integrity()
        stats = llm.scheduler.speculator.stats
    finally:
        llm.close()
    assert same_outputs([(o.token_ids, o.logprobs, o.finish_reason) for o in outs], plain)
    assert stats.drafts > 0
    if corrupt == 0:  # every token proposed stands: k + 1 tokens a verification
        assert stats.accepted_tokens == stats.draft_tokens and stats.mean_acceptance_length > 3
    if corrupt == 1:
        assert stats.accepted_tokens < stats.draft_tokens


def limits_mid_draft(stop_at: int) -> list[SamplingParams]:
    """Four requests' limits: max_tokens 5 and 13 (inside a proposal of 4),
    a stop token, and 40 tokens."""
    return [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]),
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    ]


def test_limits_mid_draft_and_small_pools(tiny_checkpoints: dict[str, Path]) -> None:
    """max_tokens landing inside a proposal, a stop token inside one, and a
    pool so small that requests are preempted: still the plain outputs."""
    model = tiny_checkpoints["llama"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    plain_greedy, _ = _run(model, prompts, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 4)
    expected = {tuple(p): out[0] for p, out in zip(prompts, plain_greedy)}
    stop_at = plain_greedy[1][0][6]
    params = limits_mid_draft(stop_at)
    for options in ({}, {"num_pages": 24}):
        plain, _ = _run(model, prompts, params, **options)
        llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=NGRAM, **options)
        try:
            llm.scheduler.speculator.proposer = OracleProposer(expected, corrupt=0)
            outs = llm.generate(prompts, params)
            llm.scheduler.check_integrity()
            kv = llm.scheduler.kv
            assert kv.allocator.num_free + kv.cache.num_pages == kv.num_usable_pages  # every page back
        finally:
            llm.close()
        assert same_outputs([(o.token_ids, o.logprobs, o.finish_reason) for o in outs], plain)
        assert outs[1].finish_reason == "stop" and outs[1].token_ids[-1] == stop_at


def test_rejected_positions_give_their_pages_back(tiny_checkpoints: dict[str, Path]) -> None:
    """A proposal that is always wrong: each verification keeps one token,
    so a request never holds more pages than its tokens need."""
    model = tiny_checkpoints["qwen3"]
    prompt = hf_encode(model, TEXTS[0])

    class Wrong:
        def propose(self, request: Request, num_tokens: int) -> list[int]:
            return [(request.all_ids[-1] + 1) % 50] * num_tokens  # almost never the model's choice

    llm = LLM(str(model), page_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    held: list[tuple[int, int]] = []
    try:
        scheduler = llm.scheduler
        scheduler.speculator.proposer = Wrong()
        original = scheduler.outputs.process

        def process(step, output):  # after each step: pages held against tokens computed
            original(step, output)
            for request in scheduler.running:
                held.append((request.admitted_kv.num_pages, scheduler.kv.pages_for(request.kv_len + 1)))

        scheduler.outputs.process = process
        llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    assert held and all(pages <= needed for pages, needed in held)


def test_the_flags_of_vllm_and_sglang() -> None:
    assert resolve_speculative(EngineConfig()) is None
    vllm = resolve_speculative(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    assert vllm == SpeculativeConfig("ngram", 3, lookup_max=4, lookup_min=2)
    sglang = resolve_speculative(EngineConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5))
    assert sglang is not None and (sglang.method, sglang.num_tokens) == ("ngram", 4)  # SGLang counts the verified one
    steps = resolve_speculative(EngineConfig(speculative_algorithm="ngram", speculative_num_steps=2))
    assert steps is not None and steps.num_tokens == 2
    for bad, message in (
        ({"speculative_config": {"method": "medusa"}}, "method must be one of"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "positive integer"),
        ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}}, "exceeds"),
        ({"speculative_config": {"method": "ngram", "lookahead": 2}}, "unknown keys"),
        ({"speculative_config": {"method": "eagle3"}}, "EAGLE-3 head's checkpoint"),
        ({"speculative_algorithm": "NGRAM", "speculative_config": {"method": "ngram"}}, "not both"),
        ({"speculative_algorithm": "MEDUSA"}, "choose from"),
        ({"speculative_num_steps": 3}, "need --speculative-algorithm"),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve_speculative(EngineConfig(**bad))


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z: the normal's), by Wilson and Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _homogeneous(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, float]:
    """Two-sample chi-square statistic and its critical value; rare tokens pooled."""
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= min_count]
    cells = [(a[t], b[t]) for t in common]
    cells.append((sum(a.values()) - sum(x for x, _ in cells), sum(b.values()) - sum(y for _, y in cells)))
    cells = [c for c in cells if sum(c) > 0]
    total_a, total_b = sum(x for x, _ in cells), sum(y for _, y in cells)
    n = total_a + total_b
    stat = 0.0
    for x, y in cells:
        for observed, total in ((x, total_a), (y, total_b)):
            expected = total * (x + y) / n
            stat += (observed - expected) ** 2 / expected
    return stat, _chi_square_critical(max(len(cells) - 1, 1))


def test_sampled_tokens_follow_the_models_distribution(tiny_checkpoints: dict[str, Path]) -> None:
    """Unseeded sampling draws from the engine's own generator, which a
    verification consumes differently: the tokens differ run to run, their
    distribution must not. Output positions 1 to 3 (verified rows, the
    later ones kept only when the proposals before them stood) compared by a chi-square
    test at p = 0.001; the engine's seed fixes every draw, so it cannot flake."""
    model = tiny_checkpoints["llama"]
    # A prompt that holds its own likely continuation (the model's greedy
    # one, then its start again): prompt lookup proposes from it. On this
    # random model few proposals stand at this temperature, so the rows
    # compared are mostly verified rows whose proposal was refused.
    base = hf_encode(model, "a b")
    llm = LLM(str(model), page_size=4)
    greedy = llm.generate([base], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].token_ids
    llm.close()
    prompt = base + greedy + base + greedy[:8]
    params = SamplingParams(max_tokens=4, temperature=0.25, ignore_eos=True)  # peaked: tokens the prompt holds
    spec = {**NGRAM, "disable_by_batch_size": 1024}
    runs = []
    for options in ({}, {"speculative_config": spec}):
        llm = LLM(str(model), page_size=4, seed=11, **options)
        try:
            runs.append([o.token_ids for o in llm.generate([prompt] * 600, params)])
            if options:
                stats = llm.scheduler.speculator.stats
                # A quarter of the 600 requests at least (lookups that find nothing back off).
                assert stats.drafts > 150 and 0 < stats.accepted_tokens < stats.draft_tokens
        finally:
            llm.close()
    plain, speculative = runs
    assert plain != speculative  # the draws differ
    for position in (1, 2, 3):
        stat, critical = _homogeneous(Counter(t[position] for t in plain), Counter(t[position] for t in speculative))
        assert stat < critical, f"output position {position}: chi-square {stat:.1f} >= {critical:.1f}"


def test_tensor_parallel_verification(tiny_checkpoints: dict[str, Path]) -> None:
    """At tp 2 the plan broadcast carries the verified drafts: the outputs
    are tp 1's plain ones."""
    model = tiny_checkpoints["llama"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params("greedy"), _params("seeded")] * 2
    plain, _ = _run(model, prompts, params)
    llm = LLM(str(model), page_size=4, tp=2, speculative_config=NGRAM)
    try:
        outs = llm.generate(prompts, params)
        assert llm.scheduler.speculator.stats.drafts > 0
    finally:
        llm.close()
    assert same_outputs([(o.token_ids, o.logprobs, o.finish_reason) for o in outs], plain)


def test_over_http_streams_equal_plain_decoding(stories_path: Path) -> None:
    """A server started with vLLM's flag streams the completions an offline
    plain run gives, several tokens a chunk where drafts stand, and reports
    its counters in /server_info and /metrics."""
    import json

    import httpx

    from server_harness import start_server

    texts = ["Once upon a time there was a girl. Once upon a time there was a", "Tom had a dog. Tom had a"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm = LLM(str(stories_path), page_size=4)
    try:
        plain = [o.text for o in llm.generate(texts, params)]
    finally:
        llm.close()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    server = start_server(stories_path, "--page-size", "4", "--debug-integrity", "--speculative-config", spec)
    try:
        for text, expected in zip(texts, plain):
            body = {"model": str(stories_path), "prompt": text, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            assert server.streamed_completion_text(body) == expected
        # SGLang's /generate reports the request's speculation in meta_info.
        body = {"text": texts[0], "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
        meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
        assert meta["completion_tokens"] == 32 and 0 < meta["spec_verify_ct"] < 32
        assert meta["spec_accept_length"] == pytest.approx(32 / meta["spec_verify_ct"])
        assert 0 < meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
        info = server.wait_idle()
        assert info["kv_integrity"] == "ok"
        assert info["avg_spec_accept_length"] > 1.0
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            assert f"aioserve:{name}_total" in metrics
        assert re.search(r'aioserve:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="0"\} [1-9]', metrics)
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_structured_output_checks_the_proposals(tiny_checkpoints: dict[str, Path], kind: str) -> None:
    """Under a grammar, proposals are cut where the matcher refuses them and
    each position's mask follows the proposed tokens before it: the outputs
    are plain decoding's, and they match the grammar."""
    from aioserve.sampling_params import StructuredOutputParams

    model = tiny_checkpoints["llama"]
    regex = r"(ab |cd ){3,12}(e|f)"
    prompts = [hf_encode(model, t) for t in ["ab cd ab cd ab cd ab", "cd cd cd cd", "ab ab ab ab ab"]]
    extra = {"temperature": 0} if kind == "greedy" else {"temperature": 0.9, "seed": 5}
    params = [SamplingParams(max_tokens=40, structured_outputs=StructuredOutputParams(regex=regex), **extra)] * 3
    plain, _ = _run(model, prompts, params)
    llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=NGRAM)
    try:
        outs = llm.generate(prompts, params)
        stats = llm.scheduler.speculator.stats
    finally:
        llm.close()
    assert same_outputs([(o.token_ids, o.logprobs, o.finish_reason) for o in outs], plain)
    assert stats.drafts > 0 and stats.accepted_tokens > 0
    for out in outs:
        if out.finish_reason == "stop":
            assert re.fullmatch(regex, out.text), out.text


@pytest.mark.parametrize("arch", ["qwen3-moe", "gemma3"])
def test_moe_and_gemma3_targets(tmp_path: Path, arch: str) -> None:
    """A mixture of experts and Gemma 3 (sliding-window layers, its own
    norms and softcapping) as targets, under proposals from the oracle (every
    token stands) and prompt lookup: the plain outputs."""
    from tiny_models import build_checkpoint

    model = build_checkpoint(arch, tmp_path / arch)
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params("greedy"), _params("seeded")] * 2
    plain, _ = _run(model, prompts, params)
    expected = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    for proposer in ("ngram", "oracle"):
        llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=NGRAM)
        try:
            if proposer == "oracle":
                llm.scheduler.speculator.proposer = OracleProposer(expected, corrupt=0)
            outs = llm.generate(prompts, params)
            assert llm.scheduler.speculator.stats.drafts > 0
        finally:
            llm.close()
        assert same_outputs([(o.token_ids, o.logprobs, o.finish_reason) for o in outs], plain), proposer


def test_chunked_prefill_and_prefix_hits(tiny_checkpoints: dict[str, Path]) -> None:
    """Prompts prefilled in chunks of 8 beside verifications, a second batch
    that finds the first's prompts in the prefix cache (only accepted tokens
    went there): the plain outputs, every page back."""
    model = tiny_checkpoints["qwen3"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params("greedy")] * len(prompts)
    results = []
    for options in ({}, {"speculative_config": NGRAM}):
        llm = LLM(str(model), page_size=4, max_prefill_tokens=8, debug_integrity=True, **options)
        try:
            first = llm.generate(prompts, params)
            second = llm.generate([p + o.token_ids[:5] for p, o in zip(prompts, first)], params)
            llm.scheduler.check_integrity()
            results.append([(o.token_ids, o.num_cached_tokens) for o in first + second])
        finally:
            llm.close()
    plain, speculative = results
    assert [t for t, _ in speculative] == [t for t, _ in plain]
    assert all(cached > 0 for _, cached in speculative[len(prompts):])


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("torch_native", "float32"), ("auto", "bfloat16")])
def test_verification_on_cuda(tmp_path: Path, backend: str, dtype: str) -> None:
    """On a GPU the verified drafts run through the attention backend's
    extend path (FlashInfer's prefill wrapper under auto, in verify graphs)
    while plain decodes replay decode graphs. float32 on the torch backend: the plain
    outputs exactly; bf16 on FlashInfer: the same outputs up to where two
    kernels' roundings split a near-tie, and there the speculative token is
    one of the plain run's top two, with the logprob the plain run gave it.
    (A share of equal tokens is no measure: on a random-weight model one
    split near-tie changes every token after it; the H200 run saw 73 of 96.)"""
    from tiny_models import build_checkpoint

    model = build_checkpoint("qwen3", tmp_path / "qwen3", overrides={
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128})
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params("greedy")] * len(prompts)
    options = {"device": "cuda", "dtype": dtype, "attention_backend": backend, "page_size": 16}
    llm = LLM(str(model), **options)
    try:
        plain_outputs = llm.generate(prompts, params)
    finally:
        llm.close()
    plain = [(o.token_ids, o.logprobs, o.finish_reason) for o in plain_outputs]
    expected = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    llm = LLM(str(model), debug_integrity=True, speculative_config=NGRAM, **options)
    try:
        llm.scheduler.speculator.proposer = OracleProposer(expected, corrupt=3)
        outs = [(o.token_ids, o.logprobs, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.scheduler.speculator.stats.accepted_tokens > 0
        llm.scheduler.check_integrity()
        # FlashInfer's verifications replay verify graphs (engine/verify_graph.py); the torch backend's run eagerly.
        verify = llm.engine.verify_graph_runner
        assert (verify is not None and verify.replays > 0) if backend == "auto" else verify is None
    finally:
        llm.close()
    if dtype == "float32":
        assert same_outputs(outs, plain)
        return
    for (tokens, logprobs, _), reference in zip(outs, plain_outputs):
        split = next((i for i, (a, b) in enumerate(zip(tokens, reference.token_ids)) if a != b), None)
        if split is None:
            assert tokens == reference.token_ids
            continue
        top = dict(reference.top_logprobs[split])  # the plain run's two best at the split
        assert tokens[split] in top, (split, tokens[split], top)
        assert abs(logprobs[split] - top[tokens[split]]) < 0.1
        assert abs(top[tokens[split]] - top[reference.token_ids[split]]) < 0.1  # a near-tie, not a wrong token


def test_proposals_that_keep_failing_give_overlap_back(tiny_checkpoints: dict[str, Path]) -> None:
    """A proposer that is always wrong: the outputs stay the plain ones, the
    request backs off (2**m - 1 chances passed up after m misses in a row),
    and while it backs off the loop plans the next step before the one in
    flight lands (overlap), waiting for tokens only around its verifications."""
    model = tiny_checkpoints["qwen3"]
    prompts = [hf_encode(model, TEXTS[2])]
    params = [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)]
    plain, _ = _run(model, prompts, params)
    expected = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=NGRAM, overlap=True)
    try:
        oracle = OracleProposer(expected, corrupt=0)
        wrong = lambda self, request, n: [t + 1 for t in oracle.propose(request, n)]  # every first token wrong
        llm.scheduler.speculator.proposer = type("Wrong", (), {"propose": wrong})()
        outs = llm.generate(prompts, params)
        llm.scheduler.check_integrity()
        stats, loop = llm.scheduler.speculator.stats, llm.scheduler.stats
    finally:
        llm.close()
    assert same_outputs([(o.token_ids, o.logprobs, o.finish_reason) for o in outs], plain)
    assert stats.accepted_tokens == 0
    # 64 tokens: chances 1, 3, 7, 15, 31, 47, 63 propose (1 + 1, 3 + 3, 7 + 7, then every 16th).
    assert 5 <= stats.drafts <= 8, stats.drafts
    # A wait before each verification's plan and before the plan after it; none between.
    assert loop.token_waits <= 2 * stats.drafts + 2 < loop.steps // 2, (loop.token_waits, loop.steps)


def test_a_lookup_that_finds_nothing_backs_off_too(tiny_checkpoints: dict[str, Path]) -> None:
    """Prompt lookup over text with nothing to quote proposes nothing; those
    chances count as misses, so the loop keeps overlap most steps."""
    model = tiny_checkpoints["qwen3"]
    llm = LLM(str(model), page_size=4, speculative_config=NGRAM, overlap=True)
    try:
        llm.scheduler.speculator.proposer = type("Nothing", (), {"propose": lambda self, request, n: []})()
        outs = llm.generate([hf_encode(model, TEXTS[2])], [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)])
        stats, loop = llm.scheduler.speculator.stats, llm.scheduler.stats
    finally:
        llm.close()
    assert len(outs[0].token_ids) == 64 and stats.drafts == 0
    assert loop.token_waits < loop.steps // 3, (loop.token_waits, loop.steps)
