"""The native kernels as one module: what `cpu_kernels()` (native.py) hands
out once the library is loaded, with the names and signatures the torch
extension had (`kernels.rms_norm(...)`, `kernels.DecoderStack(...)`)."""

from __future__ import annotations

import logging
from pathlib import Path

from aioserve.cpu.native_decoder import DecoderStack
from aioserve.cpu.native_gemm import (
    LoraPointers,
    gemm_block_width,
    gemm_fuses_multiply_add,
    int8_quantize_head,
    int8_screen_ready,
    int8_screen_rows,
    int8_screened_argmax,
    lora_add_rows,
    lora_part_blocks,
    pack_linear_weight,
    packed_linear,
    packed_linear_argmax,
    screened_argmax,
)
from aioserve.cpu.native_lib import library
from aioserve.cpu.native_ops import (
    causal_prefill_attention,
    paged_decode_attention,
    prefill_f32_ready,
    prefill_tiles_ready,
    qk_norm_rope_store,
    qk_norm_rope_store_fuses,
    rms_norm,
    rotary_embedding,
    row_max_argmax,
    silu_and_mul,
    store_kv,
)

logger = logging.getLogger(__name__)



def library_path() -> Path:
    """The loaded library's file (in the build cache)."""
    return library().path


__all__ = [
    "DecoderStack", "LoraPointers", "causal_prefill_attention", "library_path", "prefill_f32_ready", "prefill_tiles_ready", "lora_add_rows", "lora_part_blocks", "gemm_block_width",
    "gemm_fuses_multiply_add", "int8_quantize_head", "int8_screen_ready", "int8_screen_rows",
    "int8_screened_argmax",
    "pack_linear_weight", "packed_linear", "packed_linear_argmax",
    "paged_decode_attention", "qk_norm_rope_store", "qk_norm_rope_store_fuses", "rms_norm", "rotary_embedding",
    "row_max_argmax", "screened_argmax", "silu_and_mul",
    "store_kv",
]
