"""Which path a model takes on this CPU, decided in one place.

The CPU code chooses among several paths by what the machine has: the math's
dtype (half where the CPU has half-precision matrix units, float32
elsewhere), the matmul (the native packed kernel, on AMX tiles for bf16
where the CPU has them; oneDNN's inner product on weights reordered once
(float16 on AMX); or BLAS/oneDNN with a form timed per shape),
the decode step (one native DecoderStack call, or the modules) and the
greedy screen's copy of a float32 LM head (bfloat16 where the kernels dot
bf16 pairs, float16 elsewhere). `choose_cpu_dispatch` makes
all four from the CPU's flags and the options alone, so every machine's
choice can be checked on any machine (tests feed it `PERSONALITIES`), and it
returns the reason for each, which the engine logs at start.

Model-specific limits (a mixture of experts has no DecoderStack, an FP8
layer multiplies through its own scaled matmul) are the model's business and
are checked where the model is read (cpu_engine/decode_stack.py); this
decides what the machine and the options allow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# cpuinfo flags that give native matrix math per half dtype.
HALF_UNITS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}
AMX_HALF = frozenset({"amx_bf16", "amx_fp16"})
AMX_BF16 = "amx_bf16"  # the packed kernel multiplies bf16 on the tiles (native/gemm.cpp) where this is set
AMX_INT8 = "amx_int8"  # the bf16 LM head's int8 screen runs on the tiles (native/int8_head_screen.cpp)
VNNI = "avx512_vnni"  # ... or, without the tiles, on its int8 dot products (1-4 rows)
BF16_PAIR_DOTS = "avx512_bf16"  # the native kernels dot bf16 pairs (vdpbf16ps) where this is set

_AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
# The x86 families the suite must pass on, as /proc/cpuinfo names their flags.
PERSONALITIES: dict[str, frozenset[str]] = {
    "amx": _AVX512 | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"},
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "avx512": _AVX512,
    "avx2": _AVX2,
}


@dataclass(frozen=True)
class CpuDispatch:
    """The paths one model takes on one CPU, each with why."""

    math_dtype: torch.dtype
    math_reason: str
    packed_matmul: bool  # weights packed once for the native kernel (else BLAS/oneDNN)
    matmul_reason: str
    blas_tuning: bool  # where BLAS multiplies (always, or while the kernels build): forms timed per shape
    native_decode: bool  # decode-only steps as one DecoderStack call, where the model allows it
    decode_reason: str
    screen_dtype: torch.dtype | None  # the greedy screen's LM-head copy; None: no screen
    screen_reason: str
    # Greedy rows' tokens from the packed half LM head as it computes them,
    # no logits written (cpu_engine/head_argmax.py): where there is no screen.
    head_argmax: bool
    # Weights reordered once into oneDNN's blocked layout (cpu/onednn_weights.py),
    # multiplied by its inner product with no per-call reorder: "always"
    # (--cpu-matmul onednn), "timed" (a candidate beside the BLAS forms, kept
    # per weight shape where it is faster: half math on AMX), or "off".
    onednn: str = "off"
    # With head_argmax and bf16 math, steps of 1-12 greedy rows (AMX-INT8;
    # 1-4 on AVX512-VNNI) screen an int8 copy of the head
    # (cpu_engine/int8_head_screen.py); AIOSERVE_INT8_HEAD_SCREEN=0: off.
    int8_head_screen: bool = False

    def lines(self) -> list[str]:
        """One log line per choice."""
        matmul = ("native packed" if self.packed_matmul else "oneDNN prepacked" if self.onednn == "always"
                  else "BLAS/oneDNN or oneDNN prepacked" if self.onednn == "timed" else "BLAS/oneDNN")
        decode = "native DecoderStack" if self.native_decode else "modules"
        screen = _name(self.screen_dtype) + " copy" if self.screen_dtype else "off"
        if self.head_argmax:
            screen = "off, argmax in the head"
            if self.int8_head_screen:
                screen += " (a few rows: an int8 copy screened first)"
        return [
            f"math {_name(self.math_dtype)}: {self.math_reason}",
            f"matmul {matmul}: {self.matmul_reason}",
            f"decode {decode}: {self.decode_reason}",
            f"greedy screen {screen}: {self.screen_reason}",
        ]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def choose_math_dtype(
    flags: frozenset[str], weight_dtype: torch.dtype, cpu_half_compute: str = "auto"
) -> tuple[torch.dtype, str]:
    """Half math where the CPU has units for it (or it is forced), else float32."""
    if weight_dtype == torch.float32:
        return weight_dtype, "float32 weights"
    if cpu_half_compute == "native":
        return weight_dtype, "half math forced (cpu_half_compute=native)"
    if cpu_half_compute == "float32":
        return torch.float32, "float32 math asked for (cpu_half_compute=float32)"
    units = HALF_UNITS.get(weight_dtype, frozenset()) & flags
    if units:
        return weight_dtype, f"the CPU has {_name(weight_dtype)} matrix units ({', '.join(sorted(units))})"
    return torch.float32, f"no {_name(weight_dtype)} matrix units: torch's half GEMMs would be emulated"


def choose_cpu_dispatch(
    flags: frozenset[str],
    weight_dtype: torch.dtype,
    *,
    cpu_half_compute: str = "auto",
    native_kernels: bool = True,
    matmul_tuning: bool = True,
    decode_graphs: bool = True,
    tp_size: int = 1,
    matmul: str = "auto",
) -> CpuDispatch:
    """The CPU paths for weights of `weight_dtype` on a CPU with `flags`.
    `native_kernels`: the native kernels are allowed (AIOSERVE_NATIVE; built
    or building); `decode_graphs`: captured decode steps are allowed
    (--disable-cuda-graph turns them off on every device); `matmul`
    (--cpu-matmul): auto (the family's), native, onednn or blas."""
    math, math_reason = choose_math_dtype(flags, weight_dtype, cpu_half_compute)
    blas = "forms timed per weight shape at load" if matmul_tuning else "one fixed form (--disable-cpu-matmul-tuning)"
    onednn = "off"
    if matmul == "blas":
        packed, matmul_reason = False, f"BLAS asked for (--cpu-matmul blas); {blas}"
    elif matmul == "onednn":
        packed, onednn = False, "always"
        matmul_reason = "oneDNN asked for (--cpu-matmul onednn): weights reordered once into its layout"
    elif not native_kernels:
        packed, matmul_reason = False, f"the native kernels are off (AIOSERVE_NATIVE=0); {blas}"
    elif matmul == "auto" and math == torch.bfloat16 and AMX_BF16 in flags:
        packed = True
        matmul_reason = ("weights packed once in bf16 pairs, multiplied on the AMX tiles (AIOSERVE_AMX=0: the "
                         "AVX512-BF16 pair dots)")
    elif matmul == "auto" and math != torch.float32 and AMX_HALF & flags:
        packed, onednn = False, "timed"
        matmul_reason = ("half math on AMX with no tile kernel of ours for it: per weight shape, oneDNN's layout "
                         f"reordered once (not at every call) or a BLAS form, whichever is faster; {blas}")
    else:
        packed, matmul_reason = True, "weights packed once in column blocks, read at the checkpoint's width"
    if not packed:
        native_decode, decode_reason = False, "the DecoderStack needs the packed matmul"
    elif not decode_graphs:
        native_decode, decode_reason = False, "captured decode steps are off (--disable-cuda-graph)"
    elif tp_size > 1:
        native_decode, decode_reason = False, "tensor parallel (the layers all-reduce between kernels)"
    else:
        native_decode, decode_reason = True, "one native call per decode-only step, where the model's layers allow it"
    screen, screen_reason = _choose_screen(flags, weight_dtype, packed, tp_size)
    head_argmax = screen is None and packed and tp_size == 1
    int8_head_screen = False
    if head_argmax:
        screen_reason += ": greedy rows take the packed head's argmax as it computes, no logits written"
        tiles = AMX_BF16 in flags and AMX_INT8 in flags
        int8_head_screen = (math == torch.bfloat16 and (tiles or VNNI in flags)
                            and os.environ.get("AIOSERVE_INT8_HEAD_SCREEN", "1") != "0")
        if int8_head_screen:
            where = "steps of 1-12 rows on the AMX-INT8 tiles" if tiles else "steps of 1-4 rows on AVX512-VNNI"
            screen_reason += f"; {where} first screen an int8 copy of the head (half its bytes)"
    return CpuDispatch(
        math, math_reason, packed, matmul_reason, matmul_tuning, native_decode, decode_reason, screen, screen_reason,
        head_argmax, onednn, int8_head_screen,
    )


def _choose_screen(
    flags: frozenset[str], weight_dtype: torch.dtype, packed: bool, tp_size: int
) -> tuple[torch.dtype | None, str]:
    if weight_dtype != torch.float32:
        return None, "the LM head is read at half width already"
    if not packed:
        return None, "the screen reads the packed float32 LM head"
    if tp_size > 1:
        return None, "a sharded LM head would need a cross-rank argmax"
    if BF16_PAIR_DOTS in flags:
        return torch.bfloat16, "AVX512-BF16 dots bf16 pairs: half the multiply-adds too"
    return torch.float16, "a tighter bound than bf16, one float32 multiply-add per weight"
