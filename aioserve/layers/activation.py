"""Gated activations over a fused [gate | up] projection: SwiGLU and GeGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aioserve.flashinfer.elementwise import GELU_TANH_AND_MUL, SILU_AND_MUL
from aioserve.cpu.elementwise import elementwise_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = elementwise_kernels() if gate_up.is_cpu else None
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    fused = SILU_AND_MUL.kernel(gate_up)
    if fused is not None:
        return fused.activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate), tanh-approximated, times up, over a fused [gate | up].
    One FlashInfer kernel where its contract holds (two torch ops otherwise)."""
    fused = GELU_TANH_AND_MUL.kernel(gate_up)
    if fused is not None:
        return fused.activation.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
