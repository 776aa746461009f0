"""A batch plan's pages in FlashInfer's terms, built on the host.

FlashInfer's paged wrappers describe the KV of B requests with three
integer arrays instead of a padded page table:

* `indptr` [B + 1]: request i's pages are `indices[indptr[i]:indptr[i + 1]]`;
* `indices` [nnz]: the page ids, request after request, in position order;
* `last_page_len` [B]: tokens used in each request's last page (1..page_size).

and the queries of an extend batch with `qo_indptr` [B + 1] over the flat
token batch. These are built from the *host* copy of the plan, so that
planning a step never waits for the device. Pure functions, no FlashInfer:
the CPU tests check them against the slots the torch backend reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKVArgs:
    indptr: torch.Tensor  # [B + 1] int32
    indices: torch.Tensor  # [nnz] int32
    last_page_len: torch.Tensor  # [B] int32

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len.shape[0])


def paged_kv_args(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> PagedKVArgs:
    """`page_table` [B, P] and `seq_lens` [B] (host tensors) -> FlashInfer's arrays.
    Every request holds at least one token (a decode or an extend always does)."""
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("every request needs at least one KV token")
    pages = (seq_lens.long() + page_size - 1) // page_size
    indptr = torch.zeros(pages.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(page_table.shape[1])[None, :] < pages[:, None]
    indices = page_table[used].to(torch.int32)  # row-major: request by request, page by page
    last_page_len = (seq_lens.long() - (pages - 1) * page_size).to(torch.int32)
    return PagedKVArgs(indptr, indices, last_page_len)


def qo_indptr(extend_lens: torch.Tensor) -> torch.Tensor:
    """[B] new tokens per request -> [B + 1] int32 offsets into the flat token batch."""
    indptr = torch.zeros(extend_lens.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(extend_lens.long(), 0)
    return indptr


def window_left(sliding_window: int | None) -> int:
    """Our window (the last `w` positions, the query's own included) as
    FlashInfer's inclusive left bound; -1 is full attention."""
    return -1 if sliding_window is None else sliding_window - 1
