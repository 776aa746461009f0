"""The `quantization_config` of a config.json: the QuantMethod that reads
the checkpoint, chosen by its quant_method, or a clear refusal, naming the
format, for what aioserve cannot load (AWQ, GPTQ, bitsandbytes, ...; the
compressed-tensors schemes other than FP8 are refused by its reader).

What aioserve runs: FP8 e4m3 weights with per-tensor, per-channel or block
scales, written as quant_method "fp8" or as llm-compressor's
"compressed-tensors". A new format is a reader in READERS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aioserve.quant.compressed_tensors import from_compressed_tensors
from aioserve.quant.fp8 import Fp8Config
from aioserve.quant.method import QuantMethod, UnsupportedQuantization

# quant_method -> what reads its quantization_config (and refuses what it cannot load).
READERS: dict[str, Callable[[dict[str, Any]], QuantMethod]] = {
    "fp8": Fp8Config.from_fp8,
    "compressed-tensors": from_compressed_tensors,
}


def read_quantization(raw: dict[str, Any] | None) -> QuantMethod | None:
    """None for an unquantised checkpoint (no quantization_config); raises
    UnsupportedQuantization for a format aioserve cannot load."""
    if not raw:
        return None
    method = str(raw.get("quant_method") or raw.get("quantization_method") or "unknown").lower()
    reader = READERS.get(method)
    if reader is None:
        raise UnsupportedQuantization(
            f"the checkpoint is quantised as {method!r} (config.json quantization_config), which aioserve "
            "cannot load; it runs unquantised checkpoints and FP8 e4m3 weights (quant_method 'fp8', or "
            "'compressed-tensors' with FP8 weights)"
        )
    return reader(raw)
