"""Speculative decoding with an EAGLE-3 head (the eagle3 method;
engine/eagle3_runner.py): the head's proposals are the published
algorithm's (checked against a plain-torch reading of it fed by Hugging
Face's hidden states), and whatever it proposes the outputs are plain
decoding's, token for token with their logprobs, through chunked prefill,
prefix-cache hits, limits inside a proposal, preemption and aborts; the
flags of vLLM and SGLang turn it on, and a head that does not fit its
target is refused with the reason."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aioserve import LLM, SamplingParams
from aioserve.config import ConfigError, EngineConfig
from aioserve.speculative_config import resolve_speculative
from hf_reference import hf_encode
from test_speculative import TEXTS, _params, _run, same_outputs
from test_speculative_draft import (
    _tuples, _varied, abort_mid_generation, equal_twice_with_prefix_hits, http_run_equals_plain,
    plain_and_speculative, sharded_equals_single, stops_and_preemptions_equal_plain,
)


@pytest.fixture(scope="module")
def eagle_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(target, head) pairs: a 4-layer Llama whose head reads the default
    layers (2, L/2, L-3 = 2, 2, 1), and the tiny 2-layer Qwen3 whose head
    names its own (eagle_config: the outputs of layers -1, 0, 0, i.e. the
    embeddings and layer 1's input) and proposes from half the vocabulary."""
    from tiny_models import build_checkpoint, build_eagle3_head

    root = tmp_path_factory.mktemp("eagle3")
    llama = build_checkpoint("llama", root / "llama4", seed=3, overrides={"num_hidden_layers": 4})
    qwen3 = build_checkpoint("qwen3", root / "qwen3", seed=4)
    vocab = json.loads((qwen3 / "config.json").read_text())["vocab_size"]
    pairs = {
        "llama": (llama, build_eagle3_head(root / "llama4-head", llama, seed=11)),
        "qwen3": (qwen3, build_eagle3_head(root / "qwen3-head", qwen3, seed=12, draft_vocab_size=vocab // 2,
                                           aux_layer_ids=[-1, 0, 0])),
    }
    for name in ("gemma3", "qwen3-moe"):  # 3 layers each: the default reads layers 2, 1, 0
        target = build_checkpoint(name, root / name, seed=5)
        pairs[name] = (target, build_eagle3_head(root / f"{name}-head", target, seed=13))
    return pairs


def _eagle(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


@pytest.mark.parametrize(("arch", "kind"), [
    ("llama", "greedy"), ("llama", "seeded"), ("qwen3", "greedy"), ("qwen3", "seeded"),
    ("gemma3", "greedy"), ("qwen3-moe", "greedy"),
])
def test_outputs_equal_plain_decoding(eagle_targets: dict[str, tuple[Path, Path]], arch: str, kind: str) -> None:
    """A batch of prompts of different lengths, prefilled in chunks of 8,
    then the same prompts again (prefix-cache hits): the plain outputs,
    every page back, and proposals verified; dense, Gemma 3 (sliding
    windows, scaled embeddings) and mixture-of-experts targets."""
    model, head = eagle_targets[arch]
    stats = equal_twice_with_prefix_hits(model, _varied(kind), _eagle(head))
    assert stats.drafts > 0 and stats.draft_tokens > stats.drafts


# -- the published algorithm, read in plain torch ---------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated), x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class ReferenceHead:
    """EAGLE-3's head from its safetensors: fc over the target's three
    states, one layer over [norm(embedding) | norm(hidden)], the final norm,
    the draft vocabulary's LM head and d2t. Each call runs the whole
    sequence of (hidden, next token) pairs with causal attention."""

    def __init__(self, head: Path, target_embedding: torch.Tensor) -> None:
        from safetensors.torch import load_file

        self.w = load_file(str(head / "model.safetensors"))
        self.config = json.loads((head / "config.json").read_text())
        self.embedding = target_embedding

    def run(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last pair's proposal in the target's vocabulary, its pre-norm state)."""
        w, c = self.w, self.config
        eps, heads, kv_heads, head_dim = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        count = len(tokens)
        positions = torch.arange(count)
        residual = hidden
        both = torch.cat([_rms(self.embedding[tokens], w["midlayer.input_layernorm.weight"], eps),
                          _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)
        q = (both @ w["midlayer.self_attn.q_proj.weight"].T).view(count, heads, head_dim)
        k = (both @ w["midlayer.self_attn.k_proj.weight"].T).view(count, kv_heads, head_dim)
        v = (both @ w["midlayer.self_attn.v_proj.weight"].T).view(count, kv_heads, head_dim)
        q, k = _rope(q, positions, c["rope_theta"]), _rope(k, positions, c["rope_theta"])
        repeat = heads // kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5
        scores = scores.masked_fill(torch.ones(count, count, dtype=torch.bool).triu(1), float("-inf"))
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(count, -1)
        residual = residual + attended @ w["midlayer.self_attn.o_proj.weight"].T
        normed = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = (F.silu(normed @ w["midlayer.mlp.gate_proj.weight"].T) * (normed @ w["midlayer.mlp.up_proj.weight"].T))
        prenorm = residual + mlp @ w["midlayer.mlp.down_proj.weight"].T
        draft = int((_rms(prenorm[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        return torch.tensor(draft + int(w["d2t"][draft])), prenorm[-1]

    def proposals(self, sequence: list[int], aux: torch.Tensor, k: int) -> list[int]:
        """The k tokens proposed to follow `sequence` (its last token is the
        newest, at position p): the pairs (target state i, token i + 1) for
        i < p give d1; then each proposal with the head's own state."""
        fc = aux[: len(sequence) - 1] @ self.w["fc.weight"].T
        tokens, hidden = list(sequence[1:]), fc
        proposed: list[int] = []
        for _ in range(k):
            token, state = self.run(tokens, hidden)
            proposed.append(int(token))
            tokens, hidden = tokens + [int(token)], torch.cat([hidden, state[None]])
        return proposed


def test_proposals_are_the_published_algorithm(eagle_targets: dict[str, tuple[Path, Path]]) -> None:
    """Every proposal the engine's head makes for a request equals the
    reference reading of EAGLE-3 over the same tokens, fed the target's
    hidden states at layers 2, 2 and 1 as Hugging Face computes them
    (float32). A head misaligned by a position, fed the wrong layers or
    the wrong next token, or chained from the wrong state proposes other tokens."""
    from transformers import AutoModelForCausalLM

    model, head = eagle_targets["llama"]
    prompt = hf_encode(model, "the cat sat on the mat and the cat sat on the")
    llm = LLM(str(model), page_size=4, dtype="float32", speculative_config=_eagle(head, k=4))
    seen: list[tuple[int, list[int]]] = []
    try:
        runner = llm.engine.eagle3
        propose = runner.propose

        def recording(host_plan, input_ids):
            proposals, filled = propose(host_plan, input_ids)
            batch = host_plan.draft
            row = batch.requests[0]
            newest = int(host_plan.seq_lens[row]) - int(host_plan.extend_lens[row])
            seen.append((newest, proposals.tolist()))
            return proposals, filled

        runner.propose = recording
        out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    finally:
        llm.close()
    sequence = prompt + out.token_ids
    target = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[2][0], states[2][0], states[1][0]], -1)  # the inputs of layers 2, L/2, L-3
    reference = ReferenceHead(head, target.get_input_embeddings().weight.detach())
    assert len(seen) >= 3
    with torch.no_grad():
        for newest, proposals in seen:
            assert proposals == reference.proposals(sequence[: newest + 1], aux, len(proposals)), newest


def test_stop_tokens_and_preemption(eagle_targets: dict[str, tuple[Path, Path]]) -> None:
    """A stop token inside a proposal, max_tokens inside one, and a pool so
    small that requests are preempted and recomputed (the head's state
    recomputed with them): the plain outputs."""
    model, head = eagle_targets["llama"]
    stops_and_preemptions_equal_plain(model, _eagle(head, k=4))


def test_penalised_and_constrained_requests_decode_plainly_beside_proposals(
    eagle_targets: dict[str, tuple[Path, Path]]
) -> None:
    from aioserve.sampling_params import StructuredOutputParams

    model, head = eagle_targets["qwen3"]
    prompts = [hf_encode(model, t) for t in ["ab cd ab cd ab cd ab", "the cat sat on the mat", "cd cd cd cd"]]
    grammar = StructuredOutputParams(regex=r"(ab |cd ){3,12}(e|f)")
    params = [SamplingParams(max_tokens=30, structured_outputs=grammar, temperature=0),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0),
              _params("penalised")]
    plain, _ = _run(model, prompts, params)
    speculative, llm = _run(model, prompts, params, speculative_config=_eagle(head))
    assert same_outputs(speculative, plain)
    assert llm.scheduler.speculator.stats.drafts > 0


def test_an_abort_mid_generation_gives_every_page_back(eagle_targets: dict[str, tuple[Path, Path]]) -> None:
    model, head = eagle_targets["qwen3"]
    abort_mid_generation(model, _eagle(head))


def test_the_targets_decode_steps_take_the_native_step_on_a_cpu(eagle_targets: dict[str, tuple[Path, Path]]) -> None:
    """On a CPU the target's decode steps (and verifications run as decodes)
    go through the native DecoderStack, which returns the head's three states
    after the final ones: the plain outputs, proposals verified."""
    from aioserve.cpu.native import cpu_kernels
    from aioserve.cpu_engine.decode_stack import NativeDecodeRunner

    if cpu_kernels() is None:
        pytest.skip("native kernels could not be built here")
    model, head = eagle_targets["qwen3"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    params = [_params("greedy")] * len(prompts)
    plain, _ = _run(model, prompts, params)
    llm = LLM(str(model), page_size=4, speculative_config=_eagle(head))
    try:
        runner = llm.engine.graph_runner
        assert isinstance(runner, NativeDecodeRunner)
        outs = llm.generate(prompts, params)
        assert runner.replays > 0 and llm.scheduler.speculator.stats.drafts > 0
    finally:
        llm.close()
    assert same_outputs(_tuples(outs), plain)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_parallel_shards_the_head_like_the_target(eagle_targets: dict[str, tuple[Path, Path]], arch: str) -> None:
    """At --tp 2 the head's layer, its KV pool and its LM head over the draft
    vocabulary are split over the ranks as the target's are, while each rank
    keeps every slot's whole hidden state: the plain outputs, and what one
    rank proposes; the default layers and a head naming its own, with d2t."""
    model, head = eagle_targets[arch]
    assert sharded_equals_single(model, _eagle(head)).draft_tokens > 0


def test_the_flags_and_heads_that_do_not_fit(tmp_path: Path, eagle_targets: dict[str, tuple[Path, Path]]) -> None:
    sglang = resolve_speculative(EngineConfig(
        speculative_algorithm="EAGLE3", speculative_draft_model_path="h", speculative_num_draft_tokens=4))
    assert sglang is not None and (sglang.method, sglang.draft_model, sglang.num_tokens) == ("eagle3", "h", 3)
    eagle = resolve_speculative(EngineConfig(speculative_algorithm="EAGLE", speculative_draft_model_path="h"))
    assert eagle is not None and eagle.method == "eagle3"
    for bad, message in (
        ({"speculative_algorithm": "EAGLE3"}, "needs the EAGLE-3 head's checkpoint"),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve_speculative(EngineConfig(**bad))
    llama, llama_head = eagle_targets["llama"]
    qwen3, qwen3_head = eagle_targets["qwen3"]

    def edited(source: Path, name: str, change: dict) -> Path:
        copy = tmp_path / name
        shutil.copytree(source, copy)
        config = json.loads((copy / "config.json").read_text())
        config.update(change)
        (copy / "config.json").write_text(json.dumps(config))
        return copy

    cases = [
        # A 2-layer target has no layer 2 to read: the default needs a config naming the layers.
        (qwen3, llama_head, "reads hidden states of width|reads the target's layers"),
        (llama, edited(llama_head, "wide", {"target_hidden_size": 128}), "reads hidden states of width 128"),
        (llama, edited(llama_head, "vocab", {"vocab_size": 1000}), "vocabulary of 1000 tokens"),
        (llama, edited(llama_head, "arch", {"architectures": ["LlamaForCausalLM"]}), "not an EAGLE-3 head"),
        (llama, edited(llama_head, "layers", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}),
         "the target has 4 layers"),
    ]
    no_map = tmp_path / "no-d2t"
    shutil.copytree(qwen3_head, no_map)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(no_map / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(no_map / "model.safetensors"))
    cases.append((qwen3, no_map, "no d2t map"))
    for target, head, message in cases:
        with pytest.raises(ConfigError, match=message):
            LLM(str(target), page_size=4, speculative_config=_eagle(head))
    # Under tensor parallelism the head's heads must split as the target's do: refused before any rank starts.
    odd = edited(llama_head, "odd-heads", {"num_attention_heads": 3, "num_key_value_heads": 1})
    with pytest.raises(ConfigError, match="the EAGLE-3 head's 3 attention heads do not divide over 2 ranks"):
        LLM(str(llama), page_size=4, tp=2, speculative_config=_eagle(odd))


def test_over_http_with_sglangs_flags(eagle_targets: dict[str, tuple[Path, Path]]) -> None:
    """A server started with `--speculative-algorithm EAGLE3` streams the
    completion an offline plain run gives, reports the request's speculation
    in /generate's meta_info and the counters in /metrics."""
    model, head = eagle_targets["llama"]
    meta, info, metrics = http_run_equals_plain(
        model, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
        "--speculative-num-steps", "3",
    )
    assert meta["completion_tokens"] == 24 and meta["spec_verify_ct"] > 0
    assert meta["spec_num_proposed_drafts"] > 0
    assert info["avg_spec_accept_length"] >= 1.0
    assert re.search(r"aioserve:spec_decode_num_draft_tokens_total\{[^}]*\} [1-9]", metrics)


def test_flashinfer_fake_and_graphs(tmp_path: Path) -> None:
    """The GPU path's code on CPU: FlashInfer's wrappers (the enforcing
    fake, head dim 64) for the target and the head, the target's decode
    graphs (their static output carries the head's three states) and verify
    graphs, and the head's own decode and verify graphs, all replayed
    eagerly (EagerCapture): the plain outputs, with every kind replayed, and
    the head's proposals, step by step, those of the same head run without
    graphs of its own."""
    from aioserve.attention.flashinfer import FlashInferBackend
    from aioserve.engine.cuda_graph import EagerCapture
    from fake_flashinfer import fake_flashinfer
    from tiny_models import build_checkpoint, build_eagle3_head

    model = build_checkpoint("llama", tmp_path / "llama", overrides={"head_dim": 64, "num_hidden_layers": 4})
    head = build_eagle3_head(tmp_path / "head", model, seed=9)
    prompts = [hf_encode(model, t) for t in TEXTS]
    # Different lengths: the last two requests run alone for 26 tokens and more.
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in (6, 10, 36, 40)]
    options = {"dtype": "float32", "page_size": 4, "cuda_graph_max_bs": 6, "max_running_requests": 8}
    plain, _ = _run(model, prompts, params, **options)
    # Speculation only at 2 decoders or fewer: the steps before are decode-only, and replay.
    spec = {**_eagle(head), "disable_by_batch_size": 2}

    def run(head_graphs: bool) -> tuple:
        llm = LLM(str(model), debug_integrity=True, speculative_config=spec, **options)
        try:
            engine = llm.engine
            engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake_flashinfer)
            runner = engine.eagle3
            runner.attention = FlashInferBackend(runner.pool, runner.attention_shape, fake_flashinfer)
            engine.graph_runner = engine.capture_decode_graphs(EagerCapture())
            verify = engine.verify_graph_runner = engine.capture_verify_graphs(EagerCapture())
            assert verify is not None and verify.hidden.shape[1] == 4 * engine.model_config.hidden_size
            if head_graphs:
                engine.capture_draft_graphs(EagerCapture())
            proposed: list[list[int]] = []
            propose = runner.propose

            def recording(host_plan, input_ids):
                proposals, filled = propose(host_plan, input_ids)
                proposed.append(proposals.tolist())
                return proposals, filled

            runner.propose = recording
            outs = _tuples(llm.generate(prompts, params))
            llm.scheduler.check_integrity()
            assert engine.graph_runner.replays > 0 and verify.replays > 0
            assert llm.scheduler.speculator.stats.drafts > 0
        finally:
            llm.close()
        return outs, proposed, runner

    eager_outs, eager_proposed, _ = run(head_graphs=False)
    outs, proposed, runner = run(head_graphs=True)
    assert same_outputs(eager_outs, plain) and same_outputs(outs, plain)
    assert proposed == eager_proposed and len(proposed) > 3
    assert runner.decode_graphs is not None and runner.decode_graphs.replays > 0
    assert runner.verify_graphs is not None and runner.verify_graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_native", "flashinfer"])
def test_eagle3_on_cuda(tmp_path: Path, backend: str) -> None:
    """On a GPU: the head beside the target's CUDA-graph decodes (whose
    static output carries the head's three states) gives the plain outputs;
    float32 on the torch backend (the head eager), bf16 with FlashInfer
    (head dim 128; the target's verifications and the head's decodes and
    follows in graphs of their own) where the plain run is the reference
    for the tokens up to the first near-tie split."""
    from tiny_models import build_checkpoint, build_eagle3_head

    model = build_checkpoint("llama", tmp_path / "llama", overrides={
        "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 4})
    head = build_eagle3_head(tmp_path / "head", model, seed=7)
    dtype = "float32" if backend == "torch_native" else "bfloat16"
    options = {"device": "cuda", "dtype": dtype, "attention_backend": backend, "page_size": 16}
    engines: list = []
    plain, outs, stats = plain_and_speculative(model, _eagle(head), options, engines)
    assert stats.drafts > 0
    if dtype == "float32":
        assert same_outputs(outs, plain)
        return
    runner = engines[0].eagle3
    assert runner.decode_graphs is not None and runner.decode_graphs.replays > 0
    assert engines[0].verify_graph_runner is not None and engines[0].verify_graph_runner.replays > 0
    # bf16: two kernels' roundings may split a near-tie: equal at least over the first tokens
    assert all(a[0][:4] == b[0][:4] for a, b in zip(outs, plain))
