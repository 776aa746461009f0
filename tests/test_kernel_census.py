"""The kernel census (benchmarks/kernel_census.py) pins what a GPU step of
Qwen3-0.6B launches, counted on CPU through the CUDA code path: a change that
adds a kernel to a decoder layer, the head or the sampler fails here, and one
that removes kernels updates these numbers (and docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_census  # noqa: E402  (benchmarks/ is no package)

# Qwen3-0.6B at batch 1, decode and a 64-token prefill chunk.
# (q/k norms, RoPE and the KV write are one kernel of aioserve's own: flashinfer/qk_rope_store.py;
# they were four, 12 a layer, before it. A decode's gate|up GEMM and SiLU-and-mul are one more of
# our own, flashinfer/gate_up_silu.py, for up to 16 rows; a prefill chunk keeps the two.)
PER_LAYER = {"decode": 8, "prefill": 9}  # input norm, qkv, q/k norm + RoPE + KV write, attention, o, post norm,
#                                           gate_up + SiLU (prefill: gate_up, SiLU), down
LAYER_OPS = {
    "decode": {"flashinfer.norm.fused_add_rmsnorm": 2, "linear": 3, "aioserve.qk_rope_store": 1,
               "aioserve.gate_up_silu": 1},
    "prefill": {"flashinfer.norm.fused_add_rmsnorm": 2, "linear": 4, "aioserve.qk_rope_store": 1,
                "flashinfer.activation.silu_and_mul": 1},
}
SAMPLER = {"max": 1, "isfinite": 1, "where": 2}  # greedy, no logprobs: no full-vocab passes but one


@pytest.fixture(scope="module")
def qwen3_census() -> list[kernel_census.StepCensus]:
    return kernel_census.run(["qwen3-0.6b"], [1], 64)


def test_a_decoder_layer_launches_the_pinned_kernels(qwen3_census: list[kernel_census.StepCensus]) -> None:
    for step, attention in zip(qwen3_census, ("decode", "prefill")):
        layer = step.sections["layer 1"].kernels
        assert step.per_layer == PER_LAYER[attention] and step.layers_equal, (step.step, dict(layer))
        assert dict(layer) == {**LAYER_OPS[attention], f"flashinfer.attention.{attention}": 1}, step.step


def test_head_sampler_and_the_step_around_them(qwen3_census: list[kernel_census.StepCensus]) -> None:
    for step in qwen3_census:
        sections = step.sections
        assert sections["embedding"].total == 1 and sections["final norm"].total == 1
        # Greedy rows read the head's bf16 outputs: no float32 copy of the logits.
        assert dict(sections["lm head"].kernels) == {"linear": 1}
        assert dict(sections["sampler"].kernels) == SAMPLER
        assert step.host_reads == 0  # nothing waits for the device mid-step
    decode = qwen3_census[0]
    assert decode.sections["step"].total <= 14  # graph buffer copies and the batch's index arrays


def test_every_fused_op_is_taken(qwen3_census: list[kernel_census.StepCensus]) -> None:
    fused = qwen3_census[-1].fused
    for op in ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "qk_rope_store", "gate_up_silu"):
        assert fused[op]["fused"] and not fused[op]["fell_back"], (op, fused[op])


def test_the_counter_sees_a_kernel_added_to_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The census counts what the layers run: an extra copy in the MLP shows."""
    from aioserve.models import llama

    original = llama.LlamaMLP.forward

    def with_a_copy(self, x):  # type: ignore[no-untyped-def]
        return original(self, x.clone())

    monkeypatch.setattr(llama.LlamaMLP, "forward", with_a_copy)
    step = kernel_census.run(["qwen3-0.6b"], [1], 0)[0]
    assert step.per_layer == PER_LAYER["decode"] + 1 and step.sections["layer 1"].kernels["clone"] == 1
