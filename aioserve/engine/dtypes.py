"""Which dtype the weights have, which dtype the math runs in, and which
the KV cache holds.

`--dtype auto` takes the checkpoint's dtype. On a CPU without native
half-precision matrix units (AVX512-BF16 / AMX for bfloat16, AVX512-FP16 /
AMX-FP16 for float16) the math then runs in float32: torch's half GEMMs are
emulated there and several times slower (8x measured on an AVX2 EPYC at
batch 64; bf16 matmul at 0.3-0.8 GFLOP/s against ~100 in fp32). The weights
stay half all the same: the native matmul reads them half and widens them in
registers, so a decode step reads half the bytes, and the values are the
checkpoint's own, so the math is float32's exactly (what a float32 copy gave;
the KV cache of an auto choice is float32 too, see `kv_cache_dtype`). On a
CPU that has the units, half weights are computed in half (qwen3-0.6b bf16
on an AVX512-BF16 machine: 56 against 30 output tok/s at 64 streams in
float32). `cpu_half_compute="native"` forces half math. The CPU's choice is
made with its other paths in cpu/dispatch.py (`choose_math_dtype`).
"""

from __future__ import annotations

import torch

from aioserve.config import ConfigError
from aioserve.kvcache.kv_pool import FP8_KV

FP8_KV_NAMES = ("fp8", "fp8_e4m3")  # vLLM's and SGLang's names for an e4m3 KV cache
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def resolve_dtype(name: str, checkpoint_dtype: str | None) -> torch.dtype:
    """The asked dtype, else the checkpoint's."""
    name = _ALIASES.get(name, name)
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r} (auto, {', '.join(_DTYPES)})")
        return _DTYPES[name]
    return _DTYPES.get(checkpoint_dtype or "float32", torch.float32)


def kv_cache_dtype(name: str, asked_dtype: str, weight_dtype: torch.dtype, math_dtype: torch.dtype) -> torch.dtype:
    """The asked cache dtype; under `auto`, the weights' width when a dtype was
    asked for (half the bytes to hold and read when half weights are computed
    in float32), and the math's when both are auto: a CPU without half units
    then computes a half checkpoint exactly as in float32, cache included."""
    if name in FP8_KV_NAMES:
        return FP8_KV
    if name == "fp8_e5m2":
        raise ConfigError("--kv-cache-dtype fp8_e5m2 is not supported (fp8_e4m3 is, on CUDA)")
    if name != "auto":
        return resolve_dtype(name, None)
    return math_dtype if _ALIASES.get(asked_dtype, asked_dtype) == "auto" else weight_dtype
