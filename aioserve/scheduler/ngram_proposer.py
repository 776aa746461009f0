"""Prompt lookup: propose the tokens that followed an earlier occurrence of
the sequence's last n tokens (n from `lookup_max` down to `lookup_min`), in
the prompt or the output so far. No second model: what a summary quotes,
code that repeats, a list retold all continue something already seen.

The search runs on the loop's thread at every step of a speculating
request, so it runs at C speed: each request's tokens are mirrored into a
bytes-like int32 array (grown by the tokens accepted since the last step,
not rebuilt) and the suffix is found with `bytes.rfind`; a hit not on a
4-byte boundary is a coincidence of bytes and the search goes on left of it.
The most recent occurrence wins: a list being repeated continues like its
latest copy.
"""

from __future__ import annotations

import weakref
from array import array

from aioserve.scheduler.request import Request

_ITEM = 4  # bytes per token in the mirror (vocabularies stay far below 2**31)


class _Mirror:
    """One request's tokens as an int32 array, synced incrementally."""

    def __init__(self) -> None:
        self.tokens = array("i")

    def sync(self, all_ids: list[int]) -> array:
        if len(self.tokens) > len(all_ids):  # never shrinks; rebuilt should it ever
            self.tokens = array("i")
        self.tokens.extend(all_ids[len(self.tokens):])
        return self.tokens


def find_continuation(tokens: array, num_tokens: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence
    of the longest suffix (lookup_max down to lookup_min tokens) that has
    one; [] when none has."""
    length = len(tokens)
    data = tokens.tobytes()
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = data[(length - n) * _ITEM:]
        # An earlier occurrence starts at token length - n - 1 at the latest
        # (one token must follow it): its bytes end by (length - 1) * _ITEM.
        limit = (length - 1) * _ITEM
        while (at := data.rfind(suffix, 0, limit)) >= 0:
            if at % _ITEM == 0:
                start = at // _ITEM + n
                return tokens[start:start + num_tokens].tolist()
            limit = at - 1 + len(suffix)  # a misaligned match of bytes: look left of it
    return []


class NgramProposer:
    """Proposes by prompt lookup over each request's prompt and output."""

    def __init__(self, lookup_max: int, lookup_min: int) -> None:
        self.lookup_max, self.lookup_min = lookup_max, lookup_min
        self._mirrors: weakref.WeakKeyDictionary[Request, _Mirror] = weakref.WeakKeyDictionary()

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """At most `num_tokens` tokens to follow `request.all_ids`."""
        if num_tokens <= 0:
            return []
        mirror = self._mirrors.get(request)
        if mirror is None:
            mirror = self._mirrors[request] = _Mirror()
        return find_continuation(mirror.sync(request.all_ids), num_tokens, self.lookup_max, self.lookup_min)
