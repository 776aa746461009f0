"""Speculative decoding with a draft model (the draft_model method;
engine/draft_runner.py): the outputs are plain decoding's, token for token
with their logprobs, whether the draft is the target itself (nearly every
proposal stands) or an unrelated small model (nearly none does), through
chunked prefill, prefix-cache hits, limits inside a proposal, preemption and
aborts; the flags of vLLM and SGLang turn it on, and what this version
cannot serve is refused with its reason."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from aioserve import LLM, SamplingParams
from aioserve.config import ConfigError, EngineConfig
from aioserve.speculative_config import SpeculativeConfig, from_dict, resolve_speculative
from hf_reference import hf_encode
from test_speculative import TEXTS, _params, _run, limits_mid_draft, same_outputs

# Different lengths, so the batch's verifications start at different positions.
PROMPTS = TEXTS + ["one two three four five six seven eight nine ten eleven twelve thirteen fourteen"]


@pytest.fixture(scope="module")
def small_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random drafts smaller than the tiny targets (other weights, one layer,
    other head counts), with the same tokenizer: they rarely agree."""
    from tiny_models import build_checkpoint

    root = tmp_path_factory.mktemp("drafts")
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}
    return {arch: build_checkpoint(arch, root / arch, seed=5, overrides=shape) for arch in ("llama", "qwen3")}


def _draft(draft: Path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def _tuples(outs: list) -> list:
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


def _draft_path(which: str, model: Path, arch: str, small_drafts: dict[str, Path]) -> Path:
    return model if which == "target" else small_drafts[arch]


def _varied(kind: str) -> list[SamplingParams]:
    """One setting per prompt: max_tokens landing inside a proposal, and a
    penalised request (it decodes plainly beside the speculating ones)."""
    base = _params(kind)
    penalised = _params("penalised")
    return [
        SamplingParams(**{**_as_dict(base), "max_tokens": 5}),
        base,
        SamplingParams(**{**_as_dict(base), "max_tokens": 13}),
        penalised,
        SamplingParams(**{**_as_dict(base), "max_tokens": 22}),
    ]


def _as_dict(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in (
        "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "logprobs")}


def equal_twice_with_prefix_hits(model: Path, params: list[SamplingParams], speculative_config: dict):
    """PROMPTS prefilled in chunks of 8, then the first three again
    (prefix-cache hits): the plain outputs, every page back. Returns the
    speculation's counters."""
    prompts = [hf_encode(model, t) for t in PROMPTS]
    options = {"max_prefill_tokens": 8}
    plain, _ = _run(model, prompts, params, **options)
    plain_again, _ = _run(model, prompts[:3], params[:3], **options)
    llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=speculative_config, **options)
    try:
        first = llm.generate(prompts, params)
        again = llm.generate(prompts[:3], params[:3])
        llm.scheduler.check_integrity()
        kv = llm.scheduler.kv
        assert kv.allocator.num_free + kv.cache.num_pages == kv.num_usable_pages  # every page back
        stats = llm.scheduler.speculator.stats
    finally:
        llm.close()
    assert same_outputs(_tuples(first), plain)
    assert same_outputs(_tuples(again), plain_again)
    assert all(o.num_cached_tokens > 0 for o in again)
    return stats


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("which", ["target", "small"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_outputs_equal_plain_decoding(
    tiny_checkpoints: dict[str, Path], small_drafts: dict[str, Path], arch: str, which: str, kind: str
) -> None:
    """A batch of prompts of different lengths, prefilled in chunks of 8,
    then the same prompts again (prefix-cache hits, whose pages both models
    wrote): the plain outputs, every page back. The target as its own draft
    keeps nearly every proposal; the small random draft almost none."""
    model = tiny_checkpoints[arch]
    draft = _draft_path(which, model, arch, small_drafts)
    stats = equal_twice_with_prefix_hits(model, _varied(kind), _draft(draft))
    assert stats.drafts > 0
    if which == "target" and kind == "greedy":  # the target proposes its own tokens: they stand
        assert stats.accepted_tokens >= 0.8 * stats.draft_tokens, stats
        assert stats.mean_acceptance_length > 3
    if which == "small":
        assert stats.accepted_tokens < stats.draft_tokens


def test_stop_tokens_and_preemption(tiny_checkpoints: dict[str, Path], small_drafts: dict[str, Path]) -> None:
    """A stop token inside a proposal, max_tokens inside one, and a pool so
    small that requests are preempted and recomputed (through both models):
    the plain outputs."""
    model = tiny_checkpoints["llama"]
    for draft in (model, small_drafts["llama"]):
        stops_and_preemptions_equal_plain(model, _draft(draft, k=4))


def stops_and_preemptions_equal_plain(model: Path, speculative_config: dict) -> None:
    """TEXTS with limits_mid_draft's limits, then in a pool of 16 pages (the
    two 40-token requests outgrow it together): the plain outputs."""
    prompts = [hf_encode(model, t) for t in TEXTS]
    greedy = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts)
    reference, _ = _run(model, prompts, greedy)
    stop_at = reference[1][0][6]
    params = limits_mid_draft(stop_at)
    long = [params[0], greedy[1], params[2], greedy[3]]
    for options, chosen in (({}, params), ({"num_pages": 16, "decode_reserve_tokens": 4}, long)):
        plain, _ = _run(model, prompts, chosen, **options)
        speculative, llm = _run(model, prompts, chosen, speculative_config=speculative_config, **options)
        assert same_outputs(speculative, plain)
        if options:
            assert llm.scheduler.stats.preemptions > 0
        else:
            assert speculative[1][2] == "stop" and speculative[1][0][-1] == stop_at


def test_the_draft_follows_steps_that_propose_nothing(tiny_checkpoints: dict[str, Path]) -> None:
    """Above disable_by_batch_size nothing is proposed, yet the draft runs
    over every step: once requests finish and the batch is small enough, the
    target as its own draft proposes from a complete KV, so its proposals
    still stand (a draft missing those positions would guess wrong)."""
    model = tiny_checkpoints["qwen3"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in (6, 10, 36, 40)]
    plain, _ = _run(model, prompts, params)
    spec = {**_draft(model, k=4), "disable_by_batch_size": 2}
    speculative, llm = _run(model, prompts, params, speculative_config=spec)
    assert same_outputs(speculative, plain)
    stats = llm.scheduler.speculator.stats
    assert stats.drafts > 0 and stats.accepted_tokens >= 0.8 * stats.draft_tokens, stats


def test_both_pools_share_the_budget(tiny_checkpoints: dict[str, Path], small_drafts: dict[str, Path]) -> None:
    """--kv-cache-memory pays for a page of both pools: the page count is
    the budget over the two pages' bytes, and the draft's pool has as many."""
    from aioserve.kvcache.kv_pool import KVPool

    model, draft = tiny_checkpoints["llama"], small_drafts["llama"]
    budget = 64 * 1024
    llm = LLM(str(model), page_size=4, kv_cache_memory=budget, speculative_config=_draft(draft))
    try:
        engine = llm.engine
        pools = [engine.pool, engine.draft.pool]
        per_page = sum(KVPool.bytes_per_page(p.buffer.shape[0], 4, p.num_kv_heads, p.head_dim, p.dtype) for p in pools)
        assert engine.num_pages == budget // per_page
        assert engine.draft.pool.num_pages == engine.pool.num_pages
    finally:
        llm.close()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_constrained_requests_decode_plainly_beside_drafts(tiny_checkpoints: dict[str, Path], kind: str) -> None:
    """A grammar's mask would read the proposals: such a request decodes
    plainly while the others verify drafts; all give the plain outputs."""
    from aioserve.sampling_params import StructuredOutputParams

    model = tiny_checkpoints["llama"]
    prompts = [hf_encode(model, t) for t in ["ab cd ab cd ab cd ab", "the cat sat on the mat", "cd cd cd cd"]]
    extra = {"temperature": 0} if kind == "greedy" else {"temperature": 0.9, "seed": 5}
    grammar = StructuredOutputParams(regex=r"(ab |cd ){3,12}(e|f)")
    params = [SamplingParams(max_tokens=30, structured_outputs=grammar, **extra),
              SamplingParams(max_tokens=30, ignore_eos=True, **extra),
              SamplingParams(max_tokens=30, structured_outputs=grammar, **extra)]
    plain, _ = _run(model, prompts, params)
    speculative, llm = _run(model, prompts, params, speculative_config=_draft(model))
    assert same_outputs(speculative, plain)
    assert llm.scheduler.speculator.stats.drafts > 0


def abort_mid_generation(model: Path, speculative_config: dict) -> None:
    """Abort one of four requests once three verifications ran: it ends as
    an abort, the others finish, and every page is back."""
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm = LLM(str(model), page_size=4, debug_integrity=True, speculative_config=speculative_config)
    try:
        scheduler = llm.scheduler
        original = scheduler.outputs.process
        aborted: list[str] = []

        def process(step, output):
            original(step, output)
            if not aborted and scheduler.speculator.stats.drafts >= 3 and scheduler.running:
                aborted.append(scheduler.running[0].rid)
                scheduler.abort(aborted[0])

        scheduler.outputs.process = process
        outs = llm.generate(prompts, params)
        scheduler.check_integrity()
        kv = scheduler.kv
        assert kv.allocator.num_free + kv.cache.num_pages == kv.num_usable_pages
    finally:
        llm.close()
    assert aborted and sorted(o.finish_reason for o in outs) == ["abort", "length", "length", "length"]


@pytest.mark.parametrize("which", ["target", "small"])
def test_tensor_parallel_shards_the_draft_like_the_target(
    tiny_checkpoints: dict[str, Path], small_drafts: dict[str, Path], which: str
) -> None:
    """At --tp 2 the draft's layers and KV pool are split over the ranks as
    the target's are (the small draft's one KV head replicated)."""
    model = tiny_checkpoints["llama"]
    stats = sharded_equals_single(model, _draft(_draft_path(which, model, "llama", small_drafts)))
    if which == "target":
        assert stats.accepted_per_position[0] > 0.8 * stats.drafts / 2  # its greedy rows' proposals stand


def sharded_equals_single(model: Path, speculative_config: dict) -> object:
    """PROMPTS, greedy and seeded with logprobs, speculating at --tp 1 and 2:
    both give the plain outputs and the ranks propose what one rank does
    (the counters agree up to a near-tie the split sums may turn; none on an
    AVX2 EPYC). Returns the sharded run's counters."""
    prompts = [hf_encode(model, t) for t in PROMPTS]
    params = [_params("greedy" if i % 2 else "seeded") for i in range(len(prompts))]
    plain, _ = _run(model, prompts, params)
    runs = []
    for tp in (1, 2):
        llm = LLM(str(model), page_size=4, tp=tp, debug_integrity=True, speculative_config=speculative_config)
        try:
            runs.append((_tuples(llm.generate(prompts, params)), llm.scheduler.speculator.stats))
            llm.scheduler.check_integrity()
        finally:
            llm.close()
    (single, single_stats), (sharded, sharded_stats) = runs
    assert same_outputs(single, plain) and same_outputs(sharded, plain)
    assert single_stats.drafts > 0 and abs(sharded_stats.drafts - single_stats.drafts) <= 1
    assert abs(sharded_stats.accepted_tokens - single_stats.accepted_tokens) <= 3
    return sharded_stats


def test_tensor_parallel_refuses_a_draft_whose_heads_do_not_split(
    tmp_path: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    """A draft's heads must divide over --tp as the target's do: refused
    before any rank starts, naming the draft."""
    from tiny_models import build_checkpoint

    model = tiny_checkpoints["llama"]
    odd = build_checkpoint("llama", tmp_path / "odd", seed=5, overrides={
        "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 3, "num_key_value_heads": 1})
    with pytest.raises(ConfigError, match="the draft model's 3 attention heads do not divide over 2 ranks"):
        LLM(str(model), page_size=4, tp=2, speculative_config=_draft(odd))


def test_an_abort_mid_generation_gives_every_page_back(tiny_checkpoints: dict[str, Path]) -> None:
    abort_mid_generation(tiny_checkpoints["qwen3"], _draft(tiny_checkpoints["qwen3"]))


def test_the_flags_of_vllm_and_sglang(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    assert from_dict({"method": "draft_model", "model": "d", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "draft_model", 3, draft_model="d")
    only_model = from_dict({"model": "d"})  # vLLM: a model alone means a draft model
    assert (only_model.method, only_model.draft_model, only_model.num_tokens) == ("draft_model", "d", 4)
    sglang = resolve_speculative(EngineConfig(
        speculative_algorithm="STANDALONE", speculative_draft_model_path="d", speculative_num_draft_tokens=4))
    assert sglang is not None and (sglang.method, sglang.draft_model, sglang.num_tokens) == ("draft_model", "d", 3)
    for bad, message in (
        ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}}, "needs the draft's checkpoint"),
        ({"speculative_algorithm": "STANDALONE"}, "needs the draft's checkpoint"),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve_speculative(EngineConfig(**bad))
    # A draft of another vocabulary is refused when the engine loads it.
    model = tiny_checkpoints["llama"]
    other = tmp_path / "other-vocab"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 16
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="share the target's tokenizer"):
        LLM(str(model), page_size=4, speculative_config=_draft(other))


def http_run_equals_plain(model: Path, *flags: str) -> tuple[dict, dict, str]:
    """A server started with `flags` streams the completion an offline plain
    run gives; returns what /generate's meta_info reports for the same
    request, /server_info once idle (its KV bookkeeping checked) and /metrics."""
    import httpx

    from server_harness import start_server

    text = "the cat sat on the mat and the cat sat on the"
    llm = LLM(str(model), page_size=4)
    try:
        expected = llm.generate([text], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    finally:
        llm.close()
    server = start_server(model, "--page-size", "4", "--debug-integrity", *flags)
    try:
        body = {"model": str(model), "prompt": text, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert server.streamed_completion_text(body) == expected
        body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
        info = server.wait_idle()
        assert info["kv_integrity"] == "ok"
        return meta, info, httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()


def test_over_http_streams_equal_plain_decoding(tiny_checkpoints: dict[str, Path]) -> None:
    """A server started with SGLang's flags streams the completion an offline
    plain run gives, and /server_info reports the acceptance."""
    model = tiny_checkpoints["llama"]
    meta, info, metrics = http_run_equals_plain(
        model, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(model),
        "--speculative-num-steps", "3",
    )
    # SGLang's /generate reports the request's speculation in meta_info, /metrics vLLM's counters.
    assert meta["completion_tokens"] == 24 and 0 < meta["spec_verify_ct"] < 24
    assert 0 < meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
    assert info["avg_spec_accept_length"] > 3.0  # the target as its own draft: 3 proposed, nearly all stand
    assert re.search(r"aioserve:spec_decode_num_accepted_tokens_total\{[^}]*\} [1-9]", metrics)


@pytest.mark.parametrize("which", ["target", "small"])
def test_flashinfer_fake_and_graphs(tmp_path: Path, which: str) -> None:
    """The GPU path's code on CPU: FlashInfer's wrappers (the enforcing fake,
    head dim 64) for the target and the draft, and CUDA graphs replayed
    eagerly (EagerCapture) for both: the target's decode and verify graphs,
    the draft's decode graphs (its proposals, and following decode-only
    steps) and verify graphs (following verifications). The plain outputs,
    with every kind of graph replayed."""
    from aioserve.attention.flashinfer import FlashInferBackend
    from aioserve.engine.cuda_graph import EagerCapture
    from fake_flashinfer import fake_flashinfer
    from tiny_models import build_checkpoint

    model = build_checkpoint("qwen3", tmp_path / "qwen3", overrides={"head_dim": 64})
    draft = model if which == "target" else build_checkpoint("llama", tmp_path / "draft", seed=5, overrides={
        "head_dim": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1})
    prompts = [hf_encode(model, t) for t in PROMPTS]
    # Different lengths: the running requests go 5, 4, ..., 1 (graphs up to 3; speculation at 3 or fewer).
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in (6, 12, 18, 24, 30)]
    options = {"dtype": "float32", "page_size": 4, "cuda_graph_max_bs": 3, "cuda_graph": False}
    plain, _ = _run(model, prompts, params, **options)
    spec = {**_draft(draft), "disable_by_batch_size": 3}
    llm = LLM(str(model), debug_integrity=True, speculative_config=spec, **options)
    try:
        engine = llm.engine
        runner = engine.draft
        engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake_flashinfer)
        runner.attention = FlashInferBackend(runner.pool, runner.attention_shape, fake_flashinfer)
        engine.graph_runner = engine.capture_decode_graphs(EagerCapture())
        engine.verify_graph_runner = engine.capture_verify_graphs(EagerCapture())
        engine.capture_draft_graphs(EagerCapture())
        outs = _tuples(llm.generate(prompts, params))
        llm.scheduler.check_integrity()
        stats = llm.scheduler.speculator.stats
    finally:
        llm.close()
    assert same_outputs(outs, plain)
    assert stats.drafts > 0 and engine.verify_graph_runner.replays > 0
    assert runner.decode_graphs is not None and runner.decode_graphs.replays > 0
    assert runner.verify_graphs is not None and runner.verify_graphs.replays > 0
    if which == "target":
        assert stats.accepted_tokens >= 0.8 * stats.draft_tokens, stats


def plain_and_speculative(
    model: Path, speculative_config: dict, options: dict, engines: list | None = None
) -> tuple[list, list, object]:
    """PROMPTS, greedy, plainly and speculating: (plain outputs, speculative
    outputs, the speculation's counters), the KV bookkeeping checked; the
    speculating engine appended to `engines` where given."""
    prompts = [hf_encode(model, t) for t in PROMPTS]
    params = [_params("greedy")] * len(prompts)
    llm = LLM(str(model), **options)
    try:
        plain = _tuples(llm.generate(prompts, params))
    finally:
        llm.close()
    llm = LLM(str(model), debug_integrity=True, speculative_config=speculative_config, **options)
    try:
        outs = _tuples(llm.generate(prompts, params))
        stats = llm.scheduler.speculator.stats
        if engines is not None:
            engines.append(llm.engine)
        llm.scheduler.check_integrity()
    finally:
        llm.close()
    return plain, outs, stats


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("torch_native", "float32"), ("auto", "bfloat16")])
def test_draft_model_on_cuda(tmp_path: Path, backend: str, dtype: str) -> None:
    """On a GPU, the target as its own draft. float32 on the torch backend
    (the draft eager, the target's decodes in graphs): the plain outputs.
    bf16 under auto (FlashInfer): the draft's decodes and the target's
    verifications replay their graphs and nearly every proposal stands (the
    outputs may split from plain decoding's at a near-tie, as
    test_speculative.py's GPU test explains, so they are not compared)."""
    from tiny_models import build_checkpoint

    model = build_checkpoint("qwen3", tmp_path / "qwen3", overrides={
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128})
    options = {"device": "cuda", "dtype": dtype, "attention_backend": backend, "page_size": 16}
    if dtype == "float32":
        plain, outs, stats = plain_and_speculative(model, _draft(model), options)
        assert same_outputs(outs, plain)
        assert stats.accepted_tokens >= 0.8 * stats.draft_tokens, stats
        return
    prompts = [hf_encode(model, t) for t in PROMPTS]
    llm = LLM(str(model), debug_integrity=True, speculative_config=_draft(model), **options)
    try:
        outs = llm.generate(prompts, [_params("greedy")] * len(prompts))
        llm.scheduler.check_integrity()
        stats, engine = llm.scheduler.speculator.stats, llm.engine
    finally:
        llm.close()
    assert all(len(o.token_ids) == 24 for o in outs)
    assert stats.accepted_tokens >= 0.6 * stats.draft_tokens, stats
    draft = engine.draft
    assert draft is not None and draft.decode_graphs is not None and draft.decode_graphs.replays > 0
    assert engine.verify_graph_runner is not None and engine.verify_graph_runner.replays > 0
