"""native/decoder.cpp's DecoderStack (a Llama-family decode step in one
call) for torch tensors. It keeps every tensor it was given (the library
holds only their data pointers), checks them once where they come in, and
calls forward through the GIL-releasing handle (native_lib.py)."""

from __future__ import annotations

import logging

import torch

from aioserve.cpu.native_gemm import LoraPointers, packed_fields as _packed
from aioserve.cpu.native_lib import NativeLibrary, code, library

logger = logging.getLogger(__name__)


def _norm(weight: torch.Tensor, dim: int) -> tuple[int, int]:
    if weight.dim() != 1 or weight.shape[0] != dim or not weight.is_contiguous():
        raise RuntimeError("rms_norm: weight must be [D]")
    return weight.data_ptr(), code(weight, "rms_norm")


class DecoderStack:
    """A Llama-family decode step, embedded tokens to final norm."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
                 cos_cache: torch.Tensor, sin_cache: torch.Tensor, page_size: int, final_norm: torch.Tensor) -> None:
        self._lib: NativeLibrary = library()
        if (cos_cache.dtype != torch.float32 or sin_cache.dtype != torch.float32 or not cos_cache.is_contiguous()
                or not sin_cache.is_contiguous() or cos_cache.shape[1] != head_dim
                or sin_cache.shape != cos_cache.shape):
            raise RuntimeError("rotary_embedding: cos/sin caches [max_positions, D] float32")
        self.hidden_size = final_norm.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.final_norm = final_norm
        self._kept: list[object] = [cos_cache, sin_cache, final_norm]  # alive while the library points at them
        norm_ptr, norm_code = _norm(final_norm, self.hidden_size)
        self._handle = self._lib.decoder_new(
            num_heads, num_kv_heads, head_dim, self.hidden_size, eps, scale, cos_cache.data_ptr(),
            sin_cache.data_ptr(), cos_cache.shape[0], page_size, norm_ptr, norm_code,
        )
        if not self._handle:
            raise RuntimeError(self._lib.error_message())

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.decoder_free(handle)
            self._handle = None

    def add_layer(self, input_norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, o: torch.Tensor, post_norm: torch.Tensor,
                  gate_up: torch.Tensor, intermediate: int, down: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, window: int) -> None:
        size, dim = self.hidden_size, self.head_dim
        q_size, kv_size = self.num_heads * dim, self.num_kv_heads * dim
        if (q_norm is None) != (k_norm is None):
            raise RuntimeError("DecoderStack: q and k norms come together")
        bias = None
        if qkv_bias is not None:
            if qkv_bias.numel() != q_size + 2 * kv_size:
                raise RuntimeError("packed_linear: bias must have N values")
            # packed_linear converted it at every call; a float32 bias is used as it is.
            bias = qkv_bias.to(torch.float32).contiguous()
        if (key_cache.dim() != 3 or key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype
                or not key_cache.is_contiguous() or not value_cache.is_contiguous()):
            raise RuntimeError("store_kv: contiguous caches [slots, Hk, D] of one dtype")
        if key_cache.shape[1] != self.num_kv_heads or key_cache.shape[2] != dim:
            raise RuntimeError("store_kv: k and the cache's rows differ")
        q_ptr, q_code = _norm(q_norm, dim) if q_norm is not None else (0, 0)  # 0: a null pointer
        k_ptr, k_code = _norm(k_norm, dim) if k_norm is not None else (0, 0)
        self._kept += [input_norm, qkv, bias, q_norm, k_norm, o, post_norm, gate_up, down, key_cache, value_cache]
        if self._lib.decoder_add_layer(
            self._handle, *_norm(input_norm, size), *_packed(qkv, size, q_size + 2 * kv_size, "qkv"),
            bias.data_ptr() if bias is not None else 0, q_ptr, q_code, k_ptr, k_code,
            *_packed(o, q_size, size, "o"), *_norm(post_norm, size),
            *_packed(gate_up, size, 2 * intermediate, "gate_up"), intermediate,
            *_packed(down, intermediate, size, "down"), key_cache.data_ptr(), value_cache.data_ptr(),
            code(key_cache, "store_kv"), key_cache.shape[0], window,
        ):
            raise self._lib.fail()

    PROJECTIONS = ("qkv", "o", "gate_up", "down")  # decoder.cpp's Projection

    def set_lora(self, layer: int, projection: str, slots: LoraPointers) -> None:
        """A projection's LoRA slots (native_gemm.LoraPointers: each slot's
        packed A and B, which must stay where they are: they are repacked in place)."""
        self._kept.append(slots)
        if self._lib.decoder_set_lora(self._handle, layer, self.PROJECTIONS.index(projection), *slots.fields):
            raise self._lib.fail()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                seq_lens: torch.Tensor, row_slots: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """hidden [B, H] (updated in place as the residual stream); positions,
        slots [B] int64; page_table [B, P] int32, seq_lens [B] int64 (each
        with its new token); row_slots [B] int64, each row's LoRA slot (None:
        no adapters). Returns the final norm of the last layer's output, and
        with `aux_layers` after it the residual stream entering each of those
        layers (0: the embeddings), [B, (1 + len(aux_layers)) * H] in the
        final norm's dtype (models/decoder_lm.py's capture for an EAGLE-3 head)."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size or not hidden.is_contiguous():
            raise RuntimeError("DecoderStack: hidden must be contiguous [B, hidden]")
        batch = hidden.shape[0]
        if positions.dtype != torch.int64 or positions.numel() != batch:
            raise RuntimeError("rotary_embedding: positions [T] int64")
        if slots.dtype != torch.int64 or slots.numel() != batch:
            raise RuntimeError("store_kv: slots [T] int64")
        if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int64:
            raise RuntimeError("page_table int32, seq_lens int64")
        if row_slots is not None:
            if row_slots.dtype != torch.int64 or row_slots.numel() != batch:
                raise RuntimeError("DecoderStack: row_slots [B] int64")
            row_slots = row_slots.contiguous()
        positions, slots = positions.contiguous(), slots.contiguous()
        page_table, seq_lens = page_table.contiguous(), seq_lens.contiguous()
        # The kernels size their OpenMP teams by this thread's setting, which
        # torch sets on a thread's first parallel op (at::get_num_threads,
        # which the torch extension called, did it first): asked here, a
        # thread whose first op is this step gets torch's count too.
        torch.get_num_threads()
        out_dtype = hidden.dtype if self.final_norm.dtype == hidden.dtype else torch.float32
        out = torch.empty((batch, self.hidden_size), dtype=out_dtype)
        # The aux states are the residual stream's rows, in its dtype.
        aux = torch.empty((batch, len(aux_layers) * self.hidden_size), dtype=hidden.dtype) if aux_layers else None
        layers = torch.tensor(aux_layers, dtype=torch.int64) if aux_layers else None
        if self._lib.decoder_forward(
            self._handle, hidden.data_ptr(), code(hidden, "DecoderStack"), batch, positions.data_ptr(),
            slots.data_ptr(), page_table.data_ptr(), page_table.shape[1], seq_lens.data_ptr(), out.data_ptr(),
            code(out, "DecoderStack"), row_slots.data_ptr() if row_slots is not None else 0,
            aux.data_ptr() if aux is not None else 0, len(aux_layers), layers.data_ptr() if layers is not None else 0,
        ):
            raise self._lib.fail()
        return out if aux is None else torch.cat([out, aux.to(out_dtype)], dim=1)
