"""Gated activations over a fused [gate | up] projection: SwiGLU and GeGLU;
the plain activations of the encoders' MLPs, by config.json's `hidden_act`."""

from __future__ import annotations

from collections.abc import Callable

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


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU, x * Phi(x) with erf: Hugging Face's `hidden_act: gelu`
    (BERT, XLM-R). Not the tanh approximation, which differs by up to ~5e-4."""
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation: `gelu_new`, `gelu_pytorch_tanh`."""
    return F.gelu(x, approximate="tanh")


# config.json `hidden_act` -> the activation, for the ungated MLPs.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r} (supported: {', '.join(sorted(ACTIVATIONS))})") from None
