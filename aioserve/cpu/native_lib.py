"""The kernels' shared library (native/), loaded with ctypes.

The library includes no torch header (that is what makes it build in
seconds), so it sees tensors as data pointers, sizes and strides; the
torch-facing checks and allocations are in native_ops.py, native_gemm.py and
native_decoder.py. Each C function returns 0, or 1 with a message that is
raised here as RuntimeError (what torch's TORCH_CHECK raised).

The GIL: the kernels keep it while they run, as the torch extension did
(pybind11's default): they are called through a ctypes.PyDLL, which does not
release it. Released, the event loop's thread ran beside the forward's
OpenMP team and preempted one of its threads, and 2 cores lost 10-20% of
the throughput (docs/performance.md, 2026-11-23). The one exception is the
decode step (DecoderStack.forward), called through a ctypes.CDLL, which
releases it: held for a whole step, the loop could not plan the next one
meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ABI_VERSION = 10  # module.cpp's aioserve_abi_version()

# torch's dtypes as native/kernels.h numbers them (DType).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3,
    torch.float8_e4m3fn: 4,  # an FP8 KV cache's (store_kv, paged_decode_attention)
}

_i64, _i32, _f64, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_void_p

# Each C function's parameters (native/*.cpp's `*_direct` functions), in the
# order they are packed: each takes one record of 8-byte fields (int64, or
# double), which ctypes passes as one pointer (native/kernels.h, call_packed:
# per-argument conversion cost ~0.2 us apiece). All return int.
PROTOTYPES: dict[str, list[Any]] = {
    "aioserve_rms_norm": [_p, _i64, _i64, _i64, _i64, _p, _i64, _i64, _i64, _i64, _i32, _p, _i32, _p, _i64, _f64],
    "aioserve_rotary_embedding": [_p, _p, _i64, _i64, _i64, _p, _i64, _i64, _i64, _i32, _p, _p, _i64, _i64, _i64],
    "aioserve_store_kv": [_p, _i64, _i64, _p, _i64, _i64, _i32, _p, _p, _i32, _p, _i64, _i64, _i64, _i64],
    "aioserve_silu_and_mul": [_p, _p, _i32, _i64, _i64],
    "aioserve_qk_norm_rope_store_fuses": [_i32, _i32, _i64, _i32, _i32],
    "aioserve_qk_norm_rope_store": [_p, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _i32, _p, _i32, _p, _i32, _f64,
                                    _p, _p, _i64, _p, _p, _i32, _p, _i64, _i64, _i64, _i64, _i64, _p],
    "aioserve_row_max_argmax": [_p, _i64, _i64, _p, _p],
    "aioserve_paged_decode_attention": [_p, _i32, _p, _p, _i32, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f64,
                                        _i64, _p],
    "aioserve_causal_prefill_attention": [_p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _i64, _i64, _i64, _i64,
                                          _i64, _i64, _f64, _i64, _p],
    "aioserve_causal_prefill_attention_f32": [_p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _i64, _i64, _i64,
                                              _i64, _i64, _i64, _f64, _i64, _p],
    "aioserve_pack_linear_weight": [_p, _i32, _i64, _i64, _i64, _i64, _i32, _p, _i64],
    "aioserve_packed_linear": [_p, _i32, _i64, _i64, _p, _i32, _i32, _i64, _p, _p, _i32],
    "aioserve_packed_linear_argmax": [_p, _i32, _i64, _i64, _p, _i32, _i32, _i64, _p, _p, _p],
    "aioserve_screened_argmax": [_p, _i64, _i64, _p, _i32, _i32, _p, _p, _i64, _i64, _p, _p, _p],
    "aioserve_int8_quantize_head": [_p, _i64, _i64, _p, _p, _p, _p, _p, _p],
    "aioserve_int8_screened_argmax": [_p, _i64, _i64, _p, _p, _p, _p, _p, _p, _i64, _i64, _p, _p],
    "aioserve_decoder_add_layer": [_p, _p, _i32, _p, _i32, _i32, _p, _p, _i32, _p, _i32, _p, _i32, _i32, _p, _i32,
                                   _p, _i32, _i32, _i64, _p, _i32, _i32, _p, _p, _i32, _i64, _i64],
    "aioserve_decoder_set_lora": [_p, _i64, _i64, _p, _i32, _p, _i32, _i64, _i64, _i64, _p],
    "aioserve_lora_add_rows": [_p, _i32, _i64, _i64, _p, _p, _i32, _p, _i32, _i64, _i64, _i64, _p, _p, _i64],
}
# Called through the GIL-releasing handle (see above).
RELEASING_GIL: dict[str, list[Any]] = {
    "aioserve_decoder_forward": [_p, _p, _i32, _i64, _p, _p, _p, _i64, _p, _p, _i32, _p, _p, _i64, _p],
}


class NativeLibrary:
    """One loaded library: its functions as attributes (each returns 0, or
    1 when the kernel refused its arguments: `fail()` raises its message),
    and the packing's constants."""

    def __init__(self, path: Path) -> None:
        self.path = path
        holding = ctypes.PyDLL(str(path))  # keeps the GIL
        releasing = ctypes.CDLL(str(path))  # the same library (one dlopen handle), releasing it
        self._holding = holding
        self.last_error = holding.aioserve_last_error
        self.last_error.restype = ctypes.c_char_p
        self.last_error.argtypes = []
        version = holding.aioserve_abi_version()
        if version != ABI_VERSION:
            raise RuntimeError(f"{path}: native ABI {version}, expected {ABI_VERSION}")
        for table, handle in ((PROTOTYPES, holding), (RELEASING_GIL, releasing)):
            for name, argtypes in table.items():
                function = getattr(handle, name)
                function.argtypes = [ctypes.c_char_p]  # the record, a bytes object's own buffer (no copy)
                function.restype = ctypes.c_int  # checked by the caller: an errcheck hook cost ~0.4 us a call
                setattr(self, name.removeprefix("aioserve_"), _packing(function, argtypes))
        # Constants of the build, read once (packed_linear asks at every call).
        self.block_width: int = _constant(holding, "aioserve_gemm_block_width", _i64)
        self.packs_bf16_pairs = bool(_constant(holding, "aioserve_gemm_packs_bf16_pairs", _i32))
        self.fuses_multiply_add = bool(_constant(holding, "aioserve_gemm_fuses_multiply_add", _i32))
        self.prefill_tiles_built = bool(_constant(holding, "aioserve_prefill_attention_tiles_built", _i32))
        self.prefill_f32_built = bool(_constant(holding, "aioserve_prefill_attention_f32_built", _i32))
        # The int8 head screen's forms built: 1 AMX-INT8 tiles, 2 AVX512-VNNI (int8_head_screen.cpp).
        self.int8_head_screen_forms = int(_constant(holding, "aioserve_int8_head_screen_built", _i32))
        self._use_tiles = holding.aioserve_gemm_use_tiles
        self._use_tiles.argtypes, self._use_tiles.restype = [_i32], _i32
        self._tiles_in_use = holding.aioserve_gemm_tiles_in_use
        self._tiles_in_use.argtypes, self._tiles_in_use.restype = [], _i32
        # AMX tiles for bf16 products where the CPU has them (native/gemm.cpp); AIOSERVE_AMX=0: the pair dots.
        self.use_tiles(os.environ.get("AIOSERVE_AMX", "1") != "0")
        self._use_qk_norm_rope_store = holding.aioserve_qk_norm_rope_store_use
        self._use_qk_norm_rope_store.argtypes, self._use_qk_norm_rope_store.restype = [_i32], None
        # q/k norms, RoPE and the KV write in one pass where it applies (native/elementwise.cpp);
        # AIOSERVE_QK_ROPE_STORE=0 (as on a GPU: flashinfer/qk_rope_store.py): the separate ops.
        self.use_qk_norm_rope_store(os.environ.get("AIOSERVE_QK_ROPE_STORE", "1") != "0")
        self.decoder_new = holding.aioserve_decoder_new
        self.decoder_new.argtypes = [_i64, _i64, _i64, _i64, _f64, _f64, _p, _p, _i64, _i64, _p, _i32]
        self.decoder_new.restype = _p
        self.decoder_free = holding.aioserve_decoder_free
        self.decoder_free.argtypes, self.decoder_free.restype = [_p], None

    def use_tiles(self, want: bool) -> bool:
        """Route bf16 products through AMX tiles (process-wide); whether they now are."""
        return bool(self._use_tiles(int(want)))

    def use_qk_norm_rope_store(self, want: bool) -> None:
        """Let the one-pass q/k norms + RoPE + KV write serve where it applies, or keep the separate ops."""
        self._use_qk_norm_rope_store(int(want))

    def tiles_in_use(self) -> bool:
        """Whether bf16 products run on AMX tiles now (the library keeps the setting)."""
        return bool(self._tiles_in_use())

    def fail(self) -> RuntimeError:
        """The error of this thread's last failed call, to raise."""
        return RuntimeError(self.error_message())

    def error_message(self) -> str:
        message = self.last_error()
        return message.decode(errors="replace") if message else "native kernel failed"

    def __getattr__(self, name: str) -> Any:  # the functions set in __init__ (for mypy)
        raise AttributeError(name)


def _packing(function: Any, argtypes: list[Any]) -> Callable[..., int]:
    """function(*args) with the args packed into its record (null pointers as 0)."""
    pack = struct.Struct("=" + "".join("d" if t is _f64 else "q" for t in argtypes)).pack

    def call(*args: int | float) -> int:
        return int(function(pack(*args)))

    return call


def _constant(handle: ctypes.PyDLL, name: str, restype: Any) -> int:
    function = getattr(handle, name)
    function.argtypes, function.restype = [], restype
    return int(function())


_loaded: NativeLibrary | None = None


def load(path: Path) -> NativeLibrary:
    """Load the library at `path` (once per process: a second call with
    another path replaces which one the kernels call)."""
    global _loaded
    if _loaded is None or _loaded.path != path:
        _loaded = NativeLibrary(path)
        logger.debug("native kernels loaded from %s", path)
    return _loaded


def library() -> NativeLibrary:
    """The loaded library (the kernels' modules are handed out only once it is)."""
    assert _loaded is not None, "the native kernels are not loaded"
    return _loaded


def code(tensor: torch.Tensor, name: str) -> int:
    """The element type's code; RuntimeError for a dtype no kernel takes."""
    found = DTYPE_CODES.get(tensor.dtype)
    if found is None:
        raise RuntimeError(f"{name}: unsupported dtype {tensor.dtype}")
    return found
