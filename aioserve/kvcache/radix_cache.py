"""Radix prefix cache: a tree from token sequences to the KV pages holding them.

Every edge holds a run of whole pages (its tokens are a multiple of
page_size), and children are keyed by their first page's tokens, so two
prompts share exactly the pages whose tokens they share. Nodes split at page
boundaries when a match or an insert ends inside them.

A lock count on a node means a running request reads its pages; locking a
node locks its ancestors too, so an unlocked node's whole subtree is
unlocked and can go, leaves first, least recently used first.

A namespace (a LoRA adapter's id; 0 for the base model) has its own root:
KV computed under one adapter is never matched by a prompt under another.

Eviction costs what it evicts, not the size of the tree: a heap of
candidate leaves lives across calls. A node is pushed when it becomes an
evictable leaf (inserted, unlocked, or its last child evicted); an entry
that went stale meanwhile (the node got a child, a lock, or was evicted) is
dropped when it surfaces, and one whose node was used since is pushed
again with its newer time. Entries only ever hold a time at or before
their node's, so the first valid entry popped is the least recently used
evictable leaf.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import cast

from aioserve.kvcache.prefix_cache import PrefixCache, PrefixMatch


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    pages: list[int]
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    locks: int = 0
    last_used: int = 0
    alive: bool = True  # False once evicted (its heap entries are then stale)

    @property
    def evictable_leaf(self) -> bool:
        return self.alive and not self.children and self.locks == 0


class RadixCache(PrefixCache):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._roots: dict[int, _Node] = {}  # namespace -> its root (a root has no parent)
        self._clock = itertools.count(1)
        self._num_pages = 0
        self._num_locked_pages = 0
        self._num_nodes = 0
        # Eviction candidates: (last_used when pushed, tie-break, node); see the module docstring.
        self._heap: list[tuple[int, int, _Node]] = []
        self._order = itertools.count()

    # -- queries ---------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_evictable_pages(self) -> int:
        return self._num_pages - self._num_locked_pages

    def all_pages(self) -> list[int]:
        return [page for node in self._nodes() for page in node.pages]

    def _root(self, namespace: int) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), [], None)
        return root

    def _nodes(self) -> list[_Node]:
        found, stack = [], [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    # -- walking ---------------------------------------------------------

    def _shared_pages(self, node: _Node, tokens: list[int], start: int, limit: int) -> int:
        """How many of `node`'s pages equal the pages of tokens[start:limit].
        The whole run is compared at once (one C comparison), page by page
        only where it differs: a walk costs its prompt's length, not the
        prompt's length per node (a 32k-token prompt inserted chunk by chunk
        is a chain of ~125 nodes; slicing the prompt at each held the event
        loop ~30 ms a walk, seconds a step with n=128 of them)."""
        ps = self.page_size
        fits = min(len(node.pages), (limit - start) // ps)
        if node.tokens[: fits * ps] == tuple(tokens[start : start + fits * ps]):
            return fits
        count = 0
        while node.tokens[count * ps : (count + 1) * ps] == tuple(tokens[start + count * ps : start + (count + 1) * ps]):
            count += 1
        return count

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut `node` after `num_pages` pages; return the new upper half."""
        ps = self.page_size
        head = _Node(
            node.tokens[: num_pages * ps], node.pages[:num_pages], node.parent,
            locks=node.locks, last_used=node.last_used,
        )
        assert node.parent is not None  # the root is never split
        node.parent.children[node.tokens[:ps]] = head
        node.tokens, node.pages, node.parent = node.tokens[num_pages * ps :], node.pages[num_pages:], head
        head.children[node.tokens[:ps]] = node
        self._num_nodes += 1
        return head

    def _walk(self, tokens: list[int], limit: int, namespace: int) -> tuple[_Node, int]:
        """Descend along tokens[:limit] (whole pages) from the namespace's root,
        splitting the last node if the match ends inside it. Returns the
        deepest node and the tokens matched."""
        ps = self.page_size
        node, matched = self._root(namespace), 0
        while matched + ps <= limit:
            child = node.children.get(tuple(tokens[matched : matched + ps]))
            if child is None:
                break
            shared = self._shared_pages(child, tokens, matched, limit)
            if shared < len(child.pages):
                child = self._split(child, shared)
            child.last_used = next(self._clock)
            node, matched = child, matched + shared * ps
            if shared < len(node.pages):
                break
        return node, matched

    # -- the interface ---------------------------------------------------

    def match(self, tokens: list[int], namespace: int = 0) -> PrefixMatch:
        ps = self.page_size
        limit = ((len(tokens) - 1) // ps) * ps if tokens else 0
        node, matched = self._walk(tokens, limit, namespace)
        runs: list[list[int]] = []  # deepest first; prepending each would copy the pages per node
        walker: _Node | None = node
        while walker is not None and walker.parent is not None:
            runs.append(walker.pages)
            walker = walker.parent
        pages = [page for run in reversed(runs) for page in run]
        return PrefixMatch(pages, matched, node)

    def lock(self, match: PrefixMatch) -> None:
        node = cast("_Node | None", match.handle)  # a handle this cache's match() made
        while node is not None and node.parent is not None:
            if node.locks == 0:
                self._num_locked_pages += len(node.pages)
            node.locks += 1
            node = node.parent

    def unlock(self, match: PrefixMatch) -> None:
        node = cast("_Node | None", match.handle)  # a handle this cache's match() made
        while node is not None and node.parent is not None:
            node.locks -= 1
            if node.locks == 0:
                self._num_locked_pages -= len(node.pages)
                if not node.children:
                    self._push(node)
            node = node.parent

    def insert(self, tokens: list[int], pages: list[int], namespace: int = 0) -> list[int]:
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError("insert wants whole pages: len(tokens) == len(pages) * page_size")
        node, matched = self._walk(tokens, len(tokens), namespace)
        # Pages the tree already holds for the matched part make the caller's
        # copies redundant (unless they are the very same pages it matched).
        redundant, walker, end = [], node, matched // ps
        while walker.parent is not None:
            start = end - len(walker.pages)
            redundant += [mine for mine, cached in zip(pages[start:end], walker.pages) if mine != cached]
            walker, end = walker.parent, start  # the walk stops at the root
        if matched < len(tokens):
            leaf = _Node(tuple(tokens[matched:]), pages[matched // ps :], node, last_used=next(self._clock))
            node.children[leaf.tokens[:ps]] = leaf
            self._num_pages += len(leaf.pages)  # a new leaf is unlocked: evictable at once
            self._num_nodes += 1
            self._push(leaf)
        return redundant

    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        heap = self._heap
        while heap and len(freed) < num_pages:
            pushed_at, _, node = heapq.heappop(heap)
            if not node.evictable_leaf:
                continue  # stale: evicted, locked or grown since it was pushed
            if pushed_at != node.last_used:
                self._push(node)  # used since: it queues again at its newer time
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[: self.page_size]]
            node.alive = False
            freed += node.pages
            self._num_pages -= len(node.pages)
            self._num_nodes -= 1
            if parent.parent is not None and parent.evictable_leaf:
                self._push(parent)
        return freed

    def _push(self, node: _Node) -> None:
        """Queue an evictable leaf. Stale entries pile up with lock/unlock
        cycles; past twice the tree's size (amortised O(1) per push) the heap
        is rebuilt from the live candidates, one entry each."""
        heapq.heappush(self._heap, (node.last_used, next(self._order), node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            live = {id(n): n for _, _, n in self._heap if n.evictable_leaf}
            self._heap = [(n.last_used, next(self._order), n) for n in live.values()]
            heapq.heapify(self._heap)

    def reset(self) -> list[int]:
        if self._num_locked_pages:
            raise RuntimeError("cannot flush the prefix cache while requests use it")
        pages = self.all_pages()
        for node in self._nodes():
            node.alive = False
        self._roots.clear()
        self._num_pages = 0
        self._num_nodes = 0
        self._heap.clear()
        return pages
