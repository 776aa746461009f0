"""The KV pool: one preallocated tensor holding every layer's keys and values.

Storage is addressed by *slot*: slot = page * page_size + offset. Page 0 is
reserved and zeroed: padded positions of batched attention read it, so it
must hold finite numbers, and the allocator never hands it out.
"""

from __future__ import annotations

import torch

from aioserve.cpu.elementwise import elementwise_kernels
from aioserve.cpu.huge_pages import advise_huge_pages

RESERVED_PAGES = 1


FP8_KV = torch.float8_e4m3fn  # --kv-cache-dtype fp8_e4m3 (CUDA and CPU: engine/loading.py)


def to_cache_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` rounded to the cache's dtype; into FP8 saturated at its largest
    finite value (a plain cast makes NaN of anything past +-448), with no
    scale, as FlashInfer reads it (k_scale = v_scale = 1)."""
    if dtype == FP8_KV:
        limit = torch.finfo(FP8_KV).max
        return t.clamp(-limit, limit).to(dtype)
    return t.to(dtype)


def adjacent_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k and v [T, H, D] as one [2, T, H, D] view, where v's rows follow k's
    in the same rows of memory with the same strides (as they lie in a fused
    q|k|v projection when nothing replaced k); else None."""
    if k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or k.device != v.device:
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    gap = v.storage_offset() - k.storage_offset()
    if gap <= 0:
        return None
    # The view's second half is v itself (same storage, offset, strides): in bounds as v is.
    return k.as_strided((2, *k.shape), (gap, *k.stride()))


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages <= RESERVED_PAGES:
            raise ValueError(f"the KV pool needs more than {RESERVED_PAGES} page(s), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)  # [layer, k|v, slot, head, dim]
        if device.type == "cpu":
            # Written now, so the whole pool is resident before the server says
            # it is ready. Left untouched (torch.empty), each page became
            # resident the first time a request wrote it, and as the radix cache
            # keeps finished prefixes the allocator handed out fresh pages until
            # the pool was full: RSS crept ~6-9 KB per request for tens of
            # thousands of requests (issue 31), and a pool larger than the
            # machine could hold was found out hours into serving, not at start.
            # In 2 MiB pages where the OS lends them (cpu/huge_pages.py): the
            # decode attention's scattered page reads missed the TLB every 4 KiB.
            self.buffer = torch.empty(shape, dtype=dtype, device=device)
            self.huge_pages = advise_huge_pages(self.buffer)
            self.buffer.zero_()
        else:  # device memory is reserved by the allocation itself
            self.huge_pages = False
            self.buffer = torch.empty(shape, dtype=dtype, device=device)
            self.buffer[:, :, : RESERVED_PAGES * page_size].zero_()

    def keys(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k and v [T, Hk, D] into `slots`, rounded to the cache's dtype."""
        kernels = elementwise_kernels() if self.buffer.is_cpu else None
        if kernels is not None:  # one pass converting into the slots, no copies of k and v
            kernels.store_kv(k, v, self.buffer[layer, 0], self.buffer[layer, 1], slots)
            return
        both = adjacent_pair(k, v)
        if both is not None and k.dtype == self.dtype:  # k and v in one copy (one kernel on a GPU, not two)
            self.buffer[layer].index_copy_(1, slots, both)
            return
        for part, t in ((0, k), (1, v)):
            values, target = to_cache_dtype(t, self.dtype), self.buffer[layer, part]
            if self.dtype == FP8_KV:  # torch has no index_copy_ for float8: copy its bytes
                values, target = values.view(torch.uint8), target.view(torch.uint8)
            target.index_copy_(0, slots, values)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize
