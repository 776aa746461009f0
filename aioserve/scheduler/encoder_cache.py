"""Which images' embeddings the engine holds, decided here so that every
tensor-parallel rank holds the same (the plan carries the decisions: see
batch_plan.ImageBatch).

An image is encoded by the first step that computes one of its tokens and
kept while an admitted request still has tokens of it to compute: the rest
of its chunks, or another request with the same image (two requests with one
image in flight encode it once; after that the prefix cache holds its KV,
keyed by the image's content, and nothing is encoded again). A request
gives up its holds when its chunks pass the image, and all of them when it
finishes, is aborted or is preempted; an image nobody holds is evicted by
the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aioserve.batch_plan import ImageBatch, ImageRows, ImageToEncode
from aioserve.image_inputs import ImageSpan


@dataclass
class StepImages:
    """One step's image work, gathered while its plan is built."""

    encode: list[ImageToEncode] = field(default_factory=list)
    rows: list[ImageRows] = field(default_factory=list)


class EncoderCacheTable:
    def __init__(self) -> None:
        self.held: dict[int, set[str]] = {}  # image key -> ids of the requests holding it
        self.by_request: dict[str, set[int]] = {}
        # Released while an earlier plan was built (evicted first thing by
        # the next plan), and while this one is (its rows may still read them).
        self._evict: list[int] = []
        self._evict_later: list[int] = []
        self._step = StepImages()
        self.encoded = 0  # images encoded so far (a metric)

    def __len__(self) -> int:
        return len(self.held)

    def add_chunk(self, rid: str, spans: list[ImageSpan], start: int, end: int, first_row: int) -> None:
        """Request `rid` computes tokens [start, end) from row `first_row` of
        the step: the image tokens among them take their image's rows."""
        for span in spans:
            lo, hi = max(start, span.offset), min(end, span.end)
            if lo >= hi:
                continue
            key = span.image.key
            if key not in self.held:
                self.held[key] = set()
                if not self._unevict(key):
                    image = span.image
                    names = sorted(image.tensors)
                    self._step.encode.append(ImageToEncode(key, names, [image.tensors[n] for n in names]))
                    self.encoded += 1
            self._step.rows.append(
                ImageRows(first_row + lo - start, key, lo - span.offset, hi - lo, span.bidirectional)
            )
            if hi < span.end:  # more of it in a later chunk
                self.held[key].add(rid)
                self.by_request.setdefault(rid, set()).add(key)
                continue
            keys = self.by_request.get(rid)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_request[rid]
            # This plan's rows read it: evicted by the plan after the next.
            self._unhold(rid, key, self._evict_later)

    def release(self, rid: str) -> None:
        """`rid` finished, was aborted or preempted: its holds go."""
        for key in self.by_request.pop(rid, set()):
            # Between plans (or before this plan's rows): the steps already
            # planned run before the next plan's evictions.
            self._unhold(rid, key, self._evict)

    def _unhold(self, rid: str, key: int, evict: list[int]) -> None:
        """`rid` no longer needs image `key`; the last holder's going puts it on `evict`."""
        holders = self.held.get(key)
        if holders is None:
            return
        holders.discard(rid)
        if not holders:
            del self.held[key]
            evict.append(key)

    def _unevict(self, key: int) -> bool:
        """Take `key` off the evictions still to send (True: it was on one,
        so the engine holds it yet)."""
        for pending in (self._evict, self._evict_later):
            if key in pending:
                pending.remove(key)
                return True
        return False

    def take(self) -> ImageBatch | None:
        """The step's image work and the evictions released before it was
        planned (None: none of either)."""
        step, self._step = self._step, StepImages()
        evict, self._evict, self._evict_later = self._evict, self._evict_later, []
        if not step.encode and not step.rows and not evict:
            return None
        return ImageBatch(evict=evict, encode=step.encode, rows=step.rows)
