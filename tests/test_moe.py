"""Mixture of experts (Qwen3-MoE, Mixtral) on tiny random checkpoints with
8 and 4 experts, top-2: greedy equals transformers token for token through
the offline API and over HTTP; chunked prefill, prefix-cache hits and
preemption give the same tokens; tp 2 equals tp 1; the grouped matmul's two
forms agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM
from family_checks import check_chat_over_http, check_chunked_cached_preempted
from hf_reference import hf_encode
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
    check_chunked_cached_preempted(moe_checkpoints[arch])


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

    if arch == "qwen3-moe":
        path = real_vocab_checkpoint("qwen3", SHARED, tmp_path_factory.getbasetemp(), QWEN3_MOE_REAL_VOCAB)
    else:
        path = moe_checkpoints[arch]
    check_chat_over_http(path, [{"role": "user", "content": "Once upon a time the robot read about the sea"}])


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
