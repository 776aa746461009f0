"""The free list of KV pages."""

from __future__ import annotations

from aioserve.kvcache.kv_pool import RESERVED_PAGES


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # A stack: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, RESERVED_PAGES - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - RESERVED_PAGES

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        if count == 0:
            return []
        pages = self._free[-count:]
        del self._free[-count:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def free_pages(self) -> list[int]:
        return list(self._free)
