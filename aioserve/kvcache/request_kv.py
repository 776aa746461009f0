"""One admitted request's hold on KV memory.

`KVManager.admit` creates a RequestKV and only the manager changes its slot
and pages; the scheduler reads it and reports progress through two methods:
* `kv_len`: tokens whose KV is computed or scheduled (steps in flight count);
* `kv_done`: tokens whose KV is computed by steps already processed. Only
  these may go to the prefix cache: an in-flight step has not written yet.

Pages, in page-table order, are the prefix's (cached pages the request
reads under a lock; the cache owns them) followed by its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aioserve.kvcache.prefix_cache import PrefixMatch


@dataclass(eq=False)
class RequestKV:
    slot: int
    prefix: PrefixMatch
    own_pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    kv_done: int = 0
    released: bool = False
    namespace: int = 0  # its prefix-cache namespace: the LoRA adapter it runs under (0: the base model)

    @property
    def pages(self) -> list[int]:
        return self.prefix.pages + self.own_pages

    def page(self, index: int) -> int:
        """Page `index` of `pages`, without building that list."""
        cached = self.prefix.pages
        return cached[index] if index < len(cached) else self.own_pages[index - len(cached)]

    @property
    def num_pages(self) -> int:
        return len(self.prefix.pages) + len(self.own_pages)

    def scheduled(self, num_tokens: int) -> None:
        """A step now being planned computes KV up to `num_tokens` tokens."""
        self.check_live()
        self.kv_len = num_tokens

    def computed(self, num_tokens: int) -> None:
        """A processed step computed KV up to `num_tokens` tokens."""
        self.check_live()
        self.kv_done = max(self.kv_done, num_tokens)

    def check_live(self) -> None:
        if self.released:
            raise RuntimeError(f"KV of slot {self.slot} used after release")
