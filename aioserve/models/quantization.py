"""The `quantization_config` of a config.json: what aioserve can run (FP8
e4m3 weights with per-tensor or block scales) and a clear refusal, naming
the format, for what it cannot (AWQ, GPTQ, bitsandbytes, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The checkpoint tensors FP8 quantisation adds beside a weight: its scale
# (per tensor or per block; Qwen3-FP8 and DeepSeek name the block form
# `weight_scale_inv`, though it multiplies) and static activation scales.
WEIGHT_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
ACTIVATION_SCALE_SUFFIX = "input_scale"


class UnsupportedQuantization(ValueError):
    """A checkpoint quantised in a format aioserve cannot load."""


@dataclass(frozen=True)
class Fp8Config:
    """FP8 e4m3 weights; `block` (rows, cols) when each block of the weight
    has its own scale, None for one scale per tensor."""

    block: tuple[int, int] | None
    activation_scheme: str  # "dynamic" or "static" (input_scale tensors)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "Fp8Config | None":
        """None for an unquantised checkpoint; raises for a format other than FP8 e4m3."""
        if not raw:
            return None
        method = str(raw.get("quant_method") or raw.get("quantization_method") or "unknown").lower()
        if method != "fp8":
            raise UnsupportedQuantization(
                f"the checkpoint is quantised as {method!r} (config.json quantization_config), which aioserve "
                "cannot load; it runs unquantised checkpoints and FP8 (quant_method 'fp8', e4m3 weights)"
            )
        fmt = str(raw.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise UnsupportedQuantization(f"FP8 in the {fmt!r} format: aioserve loads e4m3 weights only")
        block = raw.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise UnsupportedQuantization(f"FP8 weight_block_size {block!r}: expected [rows, cols]")
        return cls(tuple(block) if block else None, str(raw.get("activation_scheme", "dynamic")))
