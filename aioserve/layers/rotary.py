"""Rotary position embedding (the "rotate half" form Llama and Qwen use),
with the frequency scalings their configs name: default, linear, llama3, yarn.

cos/sin are precomputed for every position up to the model's limit, in
float32, the way Hugging Face computes them, so greedy outputs match.

M-RoPE (Qwen2-VL, Qwen2.5-VL): a token has three positions (time, height,
width) and the frequencies are split into sections, section i rotating by
axis i's position (`RopeScaling.mrope_section`). Such a step's positions are
[3, T]; a step of text only (every axis equal, where M-RoPE is plain RoPE)
passes [T] and keeps the fast paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from aioserve.flashinfer.elementwise import ROPE
from aioserve.cpu.elementwise import elementwise_kernels


@dataclass
class RopeScaling:
    rope_type: str = "default"
    params: dict[str, float] = field(default_factory=dict)
    # M-RoPE: frequencies per axis (time, height, width), summing to head_dim / 2.
    mrope_section: tuple[int, ...] | None = None


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, float]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend in between."""
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, p: dict[str, float]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between;
    cos/sin are scaled by an attention factor."""
    factor = p["factor"]
    old_len = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier for a scaling type."""
    kind, p = scaling.rope_type, scaling.params
    if kind == "default":
        return _base_inv_freq(head_dim, theta), 1.0
    if kind == "linear":
        return _base_inv_freq(head_dim, theta) / p["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, theta), p), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, p)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def mrope_dim_axes(head_dim: int, section: tuple[int, ...]) -> torch.Tensor:
    """[head_dim] int64: which position axis each rotary dimension takes.
    Section i covers the next section[i] frequencies, in both halves (the
    cos/sin rows repeat their frequencies twice, for rotate_half)."""
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(section)} does not sum to head_dim / 2 = {head_dim // 2}")
    half = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    return torch.cat((half, half))


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # buffers (register_buffer), declared for the type checker
    sin_cache: torch.Tensor
    mrope_axes: torch.Tensor | None

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        section = scaling.mrope_section
        self.register_buffer("mrope_axes", mrope_dim_axes(head_dim, section) if section else None, persistent=False)
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", angles.sin() * attention_factor, persistent=False)
        self._step_key: tuple[torch.Tensor, torch.dtype] | None = None
        self._halves: torch.Tensor | None = None
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor] = (self.cos_cache, self.sin_cache)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by their token's position.
        On CPU with the native kernels, in place: q and k are returned rotated.
        M-RoPE positions [3, T] take plain torch (the kernels know one axis)."""
        if positions.dim() == 1:
            kernels = elementwise_kernels() if q.is_cpu else None
            if kernels is not None:
                kernels.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
                return q, k
            # (FlashInfer's cos/sin cache is built only where the kernel may be taken.)
            fused = ROPE.kernel(q, k, positions, self.cos_sin_halves()) if ROPE.may_take(q) else None
            if fused is not None:
                fused.rope.apply_rope_with_cos_sin_cache_inplace(
                    positions, q, k, q.shape[-1], self.cos_sin_halves(), is_neox=True
                )
                return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def cos_sin_halves(self) -> torch.Tensor:
        """FlashInfer's cache: [max_positions, head_dim] float32, the first half
        cos and the second sin (ours repeat each half twice, for rotate_half)."""
        if self._halves is None or self._halves.device != self.cos_cache.device:
            half = self.cos_cache.shape[1] // 2
            self._halves = torch.cat((self.cos_cache[:, :half], self.sin_cache[:, :half]), dim=1).contiguous()
        return self._halves

    def new_step(self) -> None:
        """Forget the last step's cos/sin rows: the model calls this at the
        start of every forward. (Keyed on the positions tensor alone, a
        CUDA-graph capture that follows a warm-up over the same static
        positions buffer would reuse the warm-up's rows instead of capturing
        the lookup, and every replay would rotate by the dummy positions.)"""
        self._step_key = None

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of a step's positions. Every layer shares this module
        and gets the same positions tensor, so the lookup is done once a step:
        on a GPU each op costs a kernel launch, and small steps are launch-bound."""
        if self._step_key is None or self._step_key[0] is not positions or self._step_key[1] != dtype:
            if positions.dim() == 2:
                cos, sin = self._mrope_rows(self.cos_cache, positions), self._mrope_rows(self.sin_cache, positions)
            else:
                cos, sin = self.cos_cache[positions], self.sin_cache[positions]
            cos, sin = cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
            self._step_key, self._step_cos_sin = (positions, dtype), (cos, sin)
        return self._step_cos_sin

    def _mrope_rows(self, cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, D] rows of M-RoPE positions [3, T]: dimension d from the row
        of its section's axis (Hugging Face's recomposition_frequencies)."""
        if self.mrope_axes is None:
            raise ValueError("[3, T] positions given to a rotary embedding without an mrope_section")
        rows = cache[positions]  # [3, T, D]
        axes = self.mrope_axes.view(1, 1, -1).expand(1, rows.shape[1], -1)
        return rows.gather(0, axes).squeeze(0)
