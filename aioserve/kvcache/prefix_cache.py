"""The prefix cache interface shared by the radix and the naive cache.

A cache owns the pages it holds. `match` finds cached pages for a prompt's
leading whole pages; `lock` protects them while a request uses them;
`insert` adopts a finished request's pages (returning those it already had,
for the caller to free); `evict` gives back unlocked pages, least recently
used first. A `namespace` (a LoRA adapter's id, 0 for the base model)
keeps apart KV that the same tokens gave under different weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class PrefixMatch:
    pages: list[int]  # cached pages holding the first num_tokens tokens
    num_tokens: int
    handle: object = None  # the cache's node, to lock and unlock


class PrefixCache(ABC):
    reuses = True  # whether inserted pages can be matched by later prompts

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match(self, tokens: list[int], namespace: int = 0) -> PrefixMatch:
        """Longest cached prefix of whole pages in `namespace`, never the
        last token (its logits must be computed)."""

    @abstractmethod
    def lock(self, match: PrefixMatch) -> None: ...

    @abstractmethod
    def unlock(self, match: PrefixMatch) -> None: ...

    @abstractmethod
    def insert(self, tokens: list[int], pages: list[int], namespace: int = 0) -> list[int]:
        """Adopt `pages` (len(tokens) == len(pages) * page_size); return the
        caller's pages that are now redundant and must be freed."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop up to `num_pages` unlocked pages, least recently used first."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Drop everything (nothing may be locked); return the pages."""

    @property
    @abstractmethod
    def num_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int: ...

    @abstractmethod
    def all_pages(self) -> list[int]: ...


class NaiveCache(PrefixCache):
    """No reuse: every request computes its whole prompt."""

    reuses = False

    def match(self, tokens: list[int], namespace: int = 0) -> PrefixMatch:
        return PrefixMatch([], 0)

    def lock(self, match: PrefixMatch) -> None:
        pass

    def unlock(self, match: PrefixMatch) -> None:
        pass

    def insert(self, tokens: list[int], pages: list[int], namespace: int = 0) -> list[int]:
        return list(pages)

    def evict(self, num_pages: int) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []

    @property
    def num_pages(self) -> int:
        return 0

    @property
    def num_evictable_pages(self) -> int:
        return 0

    def all_pages(self) -> list[int]:
        return []
