"""RMSNorm, computed in float32 like Hugging Face's, optionally fused with
the residual add that precedes it. On CPU, one native kernel does both; on
CUDA in half precision, FlashInfer's where its contract holds (2-D rows, and
Qwen3's per-head q/k norms over [tokens, heads, head_dim] views).
LayerNorm with a bias, for the encoders (BERT, XLM-R)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aioserve.flashinfer.elementwise import FUSED_ADD_RMSNORM, RMSNORM
from aioserve.cpu.elementwise import elementwise_kernels


@dataclass(frozen=True)
class QkNorm:
    """An attention layer's per-head q and k RMSNorms (Qwen3's), as a fused kernel applies them."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor
    eps: float


def qk_norm_arguments(norm: QkNorm | None) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """(q weight, k weight, eps) as the fused q/k kernels take them: (None, None, 0.0) for no norms."""
    return (norm.q_weight, norm.k_weight, norm.eps) if norm is not None else (None, None, 0.0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, in_place: bool = False) -> None:
        """`in_place`: FlashInfer's kernel writes the norm over its input, a
        view the caller goes on using (Qwen3's k inside the fused q|k|v
        projection: left there, beside v, the KV store is one copy, not two)."""
        super().__init__()
        self.eps = eps
        self.in_place = in_place
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        """Replicated on every rank: `loaded[:]` reads the whole tensor."""
        self.weight.data.copy_(loaded[:])

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # The same float32 math in one kernel where torch fuses it: small
            # GPU steps are bound by kernel launches, not arithmetic.
            return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual).
        On CPU with the native kernels, x + residual is written into
        `residual` itself (the caller's old residual is not needed again)."""
        kernels = elementwise_kernels() if x.is_cpu else None
        if kernels is not None:
            out = kernels.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            fused = RMSNORM.kernel(x, self.weight)
            if fused is not None:
                return fused.norm.rmsnorm(x, self.weight, self.eps, out=x if self.in_place else None)
        else:
            fused = FUSED_ADD_RMSNORM.kernel(x, residual, self.weight)
            if fused is not None:
                # In place: residual += x, then x = norm(residual) (x is this
                # layer's fresh output, and the old residual is not needed again).
                fused.norm.fused_add_rmsnorm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, as
    torch's nn.LayerNorm (what Hugging Face's BERT calls), computed in
    float32 whatever the model's dtype: half-precision statistics over
    a 1024-wide row lose digits the encoders' post-LN layers keep feeding on.
    Replicated on every rank. Checkpoints name the parameters weight and
    bias (the oldest BERT ones gamma and beta: renamed before loading)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        param = self.weight if name == "weight" else self.bias
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"LayerNorm {name}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
        param.data.copy_(loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        out = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)
