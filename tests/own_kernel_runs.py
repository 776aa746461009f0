"""One check for aioserve's own GPU kernels (flashinfer/qk_rope_store.py,
flashinfer/gate_up_silu.py), run on CPU through the CUDA code path: a tiny
bf16 model generates with the kernel's stand-in in place and without it,
and the two runs must agree within bf16's rounding."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from aioserve import LLM, SamplingParams
from aioserve.attention.flashinfer import FlashInferBackend
from aioserve.flashinfer.elementwise import FusedOp
from fake_flashinfer import fake_flashinfer
from hf_reference import hf_encode
from tiny_models import build_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_census  # noqa: E402  (the CUDA code path on CPU)

PROMPTS = ("Once upon a time there was", "1 2 3 4 5 6 7 8", "the cat sat on")


def bf16_run(model: Path, prompts: list[list[int]], kernel: Any, op: FusedOp, fused: bool) -> tuple[list, list]:
    """bfloat16 through the CUDA code path on CPU, the kernel's stand-in in
    place (`kernel`, an OptionalModule: emptied when not `fused`) or not:
    each prompt's logprobs and 12 greedy tokens; the op served exactly when fused."""
    from aioserve.engine import engine as engine_module

    with kernel_census.cuda_code_path(kernel_census.KernelCounter()):
        if not fused:
            kernel.module = None  # (cuda_code_path restores it)
        # The GPU's path: the modules in bfloat16, no packed weights or native decode step.
        cpu_paths, engine_module.CpuFastPaths = engine_module.CpuFastPaths, kernel_census.NoCpuFastPaths
        try:
            llm = LLM(str(model), dtype="bfloat16", cpu_half_compute="native", cpu_matmul_tuning=False,
                      page_size=4, cuda_graph=False, debug_integrity=True)
        finally:
            engine_module.CpuFastPaths = cpu_paths
        try:
            engine = llm.engine
            engine.cpu_paths = None
            engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake_flashinfer)
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
            outs = llm.generate(prompts, params)
            taken = op.fused()
        finally:
            llm.close()
    assert taken == fused, (op.name, taken)
    logprobs = [[entry[0] for entry in o.prompt_logprobs if entry is not None] for o in outs]
    return logprobs, [o.token_ids for o in outs]


def check_the_kernel_follows_the_separate_ones(model: Path, kernel: Any, op: FusedOp) -> None:
    """With and without the kernel: the prompts' logprobs within bf16's
    rounding (not a wrong product or rotation), the first greedy tokens
    mostly equal (random weights leave near-ties a rounding may flip)."""
    prompts = [hf_encode(model, t) for t in PROMPTS]
    fused_lp, fused_tokens = bf16_run(model, prompts, kernel, op, fused=True)
    separate_lp, separate_tokens = bf16_run(model, prompts, kernel, op, fused=False)
    for got, expected in zip(fused_lp, separate_lp):
        assert len(got) == len(expected)
        assert max(abs(a - b) for a, b in zip(got, expected)) < 0.05
    assert sum(a[:4] == b[:4] for a, b in zip(fused_tokens, separate_tokens)) >= 2


def head_dim_64_models(root: Path) -> dict[str, Path]:
    """Tiny Qwen3 (q/k norms) and Llama-3 (its RoPE scaling) of head dim 64: shapes the kernels take."""
    return {arch: build_checkpoint(arch, root / arch, overrides={"head_dim": 64}) for arch in ("qwen3", "llama3-rope")}
