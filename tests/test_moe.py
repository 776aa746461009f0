"""Mixture of experts (Qwen3-MoE, Mixtral) on tiny random checkpoints with
8 and 4 experts, top-2: greedy equals transformers token for token through
the offline API and over HTTP; chunked prefill, prefix-cache hits and
preemption give the same tokens; tp 2 equals tp 1; the grouped matmul's two
forms agree."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode, hf_greedy, hf_tokenizer
from test_greedy_matches_hf import PROMPTS, check_against_hf
from test_tp_offline import check_tp2_matches_tp1
from tiny_models import MOE_ARCHITECTURES, build_checkpoint


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: build_checkpoint(name, root / name) for name in MOE_ARCHITECTURES}


@pytest.mark.parametrize("arch", list(MOE_ARCHITECTURES))
def test_greedy_matches_transformers(arch: str, moe_checkpoints: dict[str, Path]) -> None:
    path = moe_checkpoints[arch]
    llm = LLM(str(path), page_size=4)
    try:
        layers = llm.engine.model.model.layers
        kinds = [type(layer.mlp).__name__ for layer in layers]
        # Qwen3-MoE's mlp_only_layers=[1] keeps a dense MLP there; Mixtral is sparse throughout.
        expected = ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"] if arch == "qwen3-moe" else ["SparseMoeBlock"] * 2
        assert kinds == expected
        check_against_hf(path, llm, [hf_encode(path, p) for p in PROMPTS])
    finally:
        llm.close()


@pytest.mark.parametrize("arch", list(MOE_ARCHITECTURES))
def test_chunked_prefill_prefix_cache_and_preemption(arch: str, moe_checkpoints: dict[str, Path]) -> None:
    """A 16-token prefill budget chunks the long prompts; the second round
    hits the prefix cache; a pool too small for all at once preempts."""
    path = moe_checkpoints[arch]
    prompts = [hf_encode(path, p) for p in PROMPTS[1:3]] + [list(range(20 + i, 60 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [hf_greedy(path, p, 16)[0] for p in prompts]
    llm = LLM(str(path), page_size=4, max_prefill_tokens=16, num_pages=40, decode_reserve_tokens=4)
    try:
        first = llm.generate(prompts, params)
        assert [o.token_ids for o in first] == expected
        assert llm.stats.preemptions > 0
        for _ in range(2):  # the second time from the prefix cache
            again = llm.generate(prompts[:1], params)[0]
            assert again.token_ids == expected[0]
        assert again.num_cached_tokens >= 16
        llm.scheduler.check_integrity()
    finally:
        llm.close()


# Qwen3-MoE with Qwen3's real tokenizer and chat template (thinking markup and all).
QWEN3_MOE_REAL_VOCAB = ("Qwen3MoeConfig", {
    "head_dim": 16, "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": False,
})


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_chat_over_http_matches_transformers(
    arch: str, moe_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The server: a chat completion through the model's chat template equals
    transformers' greedy continuation of that prompt, logprobs included.
    Qwen3-MoE with Qwen3's real template (and norm_topk_prob off), Mixtral
    with the tiny ChatML one."""
    from conftest import SHARED
    from real_vocab_models import real_vocab_checkpoint
    from server_harness import start_server

    if arch == "qwen3-moe":
        path = real_vocab_checkpoint("qwen3", SHARED, tmp_path_factory.getbasetemp(), QWEN3_MOE_REAL_VOCAB)
    else:
        path = moe_checkpoints[arch]
    messages = [{"role": "user", "content": "Once upon a time the robot read about the sea"}]
    prompt = hf_tokenizer(str(path)).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_encode(path, prompt)
    expected, expected_logprobs = hf_greedy(path, ids, 12)
    server = start_server(path, "--page-size", "4")
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=server.info()["model"], messages=messages, max_tokens=12, temperature=0, logprobs=True,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
        got = [t.logprob for t in out.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs, strict=True)) < 1e-4
        # The text, but for a trailing partial UTF-8 character the server holds back.
        text = hf_tokenizer(str(path)).decode(expected, skip_special_tokens=False)
        content = out.choices[0].message.content
        assert text.startswith(content) and len(content) >= len(text.rstrip("\ufffd"))
    finally:
        server.stop()


@pytest.mark.parametrize("arch", list(MOE_ARCHITECTURES))
def test_tp2_equals_tp1(arch: str, moe_checkpoints: dict[str, Path]) -> None:
    """Each expert's intermediate dimension split over two ranks (gloo)."""
    check_tp2_matches_tp1(moe_checkpoints[arch])


def test_grouped_matmul_forms_agree() -> None:
    """torch's grouped matmul (aligned shapes), the per-expert form
    (unaligned), the masked form (CUDA graph capture) and the native kernel over packed experts (when built)
    compute the same products; experts with no rows are skipped."""
    from aioserve.cpu.native import cpu_kernels
    from aioserve.layers.moe import grouped_matmul, masked_grouped_matmul, packed_grouped_matmul

    kernels = cpu_kernels(wait=True)

    torch.manual_seed(0)
    for rows, k, n in ((10, 16, 8), (7, 6, 5)):
        x = torch.randn(rows, k)
        w = torch.randn(4, n, k)
        ends = torch.tensor([3, 3, 8, rows], dtype=torch.int32).clamp(max=rows)
        out = grouped_matmul(x, w, ends)
        starts = [0] + ends.tolist()[:-1]
        ref = torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip(starts, ends.tolist()))])
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(masked_grouped_matmul(x, w.transpose(1, 2), ends), ref)  # CUDA graphs' form
        if kernels is not None:
            packed = [kernels.pack_linear_weight(w[i].contiguous()) for i in range(4)]
            torch.testing.assert_close(packed_grouped_matmul(x, packed, n, ends, kernels), ref)
