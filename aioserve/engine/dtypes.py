"""Which dtype the weights have, and which dtype the math runs in.

`--dtype auto` takes the checkpoint's dtype, with one exception: a half
precision checkpoint on a CPU without native half-precision matrix units
(AVX512-BF16 / AMX for bfloat16, AVX512-FP16 / AMX-FP16 for float16) loads in
float32. There, torch's half GEMMs are emulated and several times slower than
float32 (8x measured on an AVX2 EPYC at batch 64; bf16 matmul at 0.3-0.8
GFLOP/s against ~100 in fp32), while the float32 copy holds the very same
values. On a CPU that has the units, half weights stay half: half the bytes
to read per decode step and the native matrix rate (qwen3-0.6b bf16 on an
AVX512-BF16 machine: 56 against 30 output tok/s at 64 streams in float32).

Weights and math differ in one case: half weights asked for explicitly on a
CPU without the units are rounded to that dtype and computed in float32 (the
same values, faster and more exactly); `cpu_half_compute="native"` forces
half math.
"""

from __future__ import annotations

import functools
import logging

import torch

from aioserve.cpu_info import cpu_flags

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# cpuinfo flags that give native matrix math per half dtype.
_NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """The asked dtype; else the checkpoint's, except that half precision on
    a CPU without native half matrix math becomes float32."""
    name = _ALIASES.get(name, name)
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(_DTYPES)})")
        return _DTYPES[name]
    dtype = _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if device.type == "cpu" and not cpu_has_native(dtype):
        return torch.float32
    return dtype


@functools.lru_cache(maxsize=1)
def cpu_has_native(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or bool(_NATIVE_FLAGS.get(dtype, set()) & cpu_flags())


def compute_dtype(dtype: torch.dtype, device: torch.device, cpu_half_compute: str = "auto") -> torch.dtype:
    if device.type != "cpu" or dtype == torch.float32 or cpu_half_compute == "native":
        return dtype
    if cpu_half_compute == "float32" or not cpu_has_native(dtype):
        logger.info(
            "this CPU has no native %s matrix math: computing in float32 with %s-rounded weights",
            str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."),
        )
        return torch.float32
    return dtype
