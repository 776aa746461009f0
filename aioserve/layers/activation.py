"""Gated activations over a fused [gate | up] projection: SwiGLU and GeGLU;
the plain activations of the encoders' MLPs, by config.json's `hidden_act`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from aioserve.flashinfer.elementwise import GELU_TANH_AND_MUL, SILU_AND_MUL
from aioserve.flashinfer.gate_up_silu import GATE_UP_SILU
from aioserve.cpu.elementwise import elementwise_kernels
from aioserve.layers.linear import MergedColumnParallelLinear


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = elementwise_kernels() if gate_up.is_cpu else None
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    fused = SILU_AND_MUL.kernel(gate_up)
    if fused is not None:
        return fused.activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_and_silu(gate_up_proj: MergedColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] projection of x (SwiGLU's
    input to the down projection). On a GPU, for the few rows of a small
    decode batch, one kernel of aioserve's own where the layer is a plain
    half-precision matmul and the kernel proved itself faster
    (flashinfer/gate_up_silu.py); else the projection and silu_and_mul."""
    def separate(rows: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up_proj(rows))

    plain = gate_up_proj.quant is None and gate_up_proj.lora is None and gate_up_proj.bias is None
    if plain and x.dim() == 2:
        kernels = GATE_UP_SILU.kernel(x, gate_up_proj.weight)  # None off a GPU, past 16 rows, or refused
        fused = None if kernels is None else GATE_UP_SILU.run(kernels, x, gate_up_proj.weight, separate)
        if fused is not None:
            return fused
    return separate(x)


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
