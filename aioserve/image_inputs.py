"""Images in a prompt, as plain data: what intake hands the scheduler and the
scheduler hands the engine. Imports nothing of the project.

An image enters a prompt as a run of placeholder tokens (Qwen2.5-VL's
`<|image_pad|>` repeated once per merged patch), whose input embeddings the
engine takes from the model's vision encoder instead of the token table.
The prompt's token ids keep the placeholder id; the prefix cache is keyed by
`cache_ids`, in which each image's placeholders become an id derived from
the image's content (past the vocabulary, so no real token can equal one):
two requests with the same image share its KV, two different images never do.

M-RoPE (Qwen2-VL's and Qwen2.5-VL's rotary) gives each token three
positions (time, height, width): text tokens have all three equal, an
image's tokens walk its grid. `mrope_positions` computes a prompt's [3, L]
positions and the delta a generated token's position takes (its KV index
plus the delta, all three axes equal).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Cache ids of image placeholders start here: past any vocabulary (the
# largest published ones are ~260k rows), within int64.
IMAGE_CACHE_ID_BASE = 1 << 40


def content_key(tensors: dict[str, torch.Tensor]) -> int:
    """A 62-bit key of processed image tensors: the same pixels, processed
    the same way, give the same key (the encoder's input is what is hashed,
    so two files that decode to one image share it)."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return int.from_bytes(digest.digest(), "little") >> 2


@dataclass(eq=False)
class ProcessedImage:
    """One image as the checkpoint's own image processor made it."""

    key: int  # content_key(tensors)
    # The processor's outputs for this image alone, on the CPU. Qwen2.5-VL:
    # pixel_values [patches, C*T*P*P] and image_grid_thw [1, 3].
    tensors: dict[str, torch.Tensor]
    num_tokens: int  # placeholder tokens it takes in the prompt (rows of its embedding)
    # Its token grid in the language model's units (time, height, width after
    # the encoder's patch merge): what M-RoPE positions walk. (1, 1, n) when
    # the model has no use for it.
    grid: tuple[int, int, int] = (1, 1, 1)
    nbytes: int = 0  # of `tensors`, for the request's cost

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(eq=False)
class ImageSpan:
    """Where an image's placeholder tokens sit in a prompt."""

    image: ProcessedImage
    offset: int  # index of its first placeholder token in the prompt
    # The model attends among this image's tokens both ways (Gemma 3): a
    # prefill chunk must then hold the rest of the image whole.
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens

    @property
    def cache_id(self) -> int:
        return IMAGE_CACHE_ID_BASE + self.image.key


@dataclass(eq=False)
class PromptImages:
    """A prompt's images, in prompt order, and what follows from them."""

    spans: list[ImageSpan]
    mrope: torch.Tensor | None = None  # [3, L] int64 M-RoPE positions of the prompt (None: plain positions)
    rope_delta: int = 0  # a token after the prompt sits at its KV index + this (M-RoPE)
    num_tokens: int = field(init=False)  # placeholder tokens of all images

    def __post_init__(self) -> None:
        self.spans = sorted(self.spans, key=lambda span: span.offset)
        self.num_tokens = sum(span.image.num_tokens for span in self.spans)
        for before, after in zip(self.spans, self.spans[1:]):
            if after.offset < before.end:
                raise ValueError("image spans overlap")

    def cache_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's ids as the prefix cache keys them: each image's
        placeholders replaced by its content's id."""
        ids = list(prompt_ids)
        for span in self.spans:
            ids[span.offset : span.end] = [span.cache_id] * span.image.num_tokens
        return ids

    def spans_in(self, start: int, end: int) -> list[ImageSpan]:
        """The spans with a token in [start, end)."""
        return [span for span in self.spans if span.offset < end and span.end > start]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of tokens [start, end) of the
        request: the prompt's own, then generated tokens' (index + delta)."""
        assert self.mrope is not None
        prompt_len = self.mrope.shape[1]
        inside = self.mrope[:, start:min(end, prompt_len)]
        if end <= prompt_len:
            return inside
        after = torch.arange(max(start, prompt_len), end, dtype=torch.long) + self.rope_delta
        return torch.cat((inside, after.expand(3, -1)), dim=1)


def mrope_positions(prompt_len: int, spans: Sequence[ImageSpan]) -> tuple[torch.Tensor, int]:
    """[3, prompt_len] M-RoPE positions and the delta of the tokens after the
    prompt, as Qwen2.5-VL computes them for still images: text runs on from
    the last position; an image's tokens sit at (start, start + row, start +
    col) of its grid; the text after it starts at start + max(rows, cols)."""
    positions = torch.empty(3, prompt_len, dtype=torch.long)
    current, cursor = 0, 0
    for span in sorted(spans, key=lambda s: s.offset):
        text = span.offset - cursor
        positions[:, cursor:span.offset] = torch.arange(current, current + text)
        current += text
        t, h, w = span.image.grid
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        grid = torch.stack((tt.flatten(), hh.flatten(), ww.flatten())) + current
        if grid.shape[1] != span.image.num_tokens:
            raise ValueError(f"an image of grid {span.image.grid} cannot fill {span.image.num_tokens} tokens")
        positions[:, span.offset:span.end] = grid
        current += max(h, w)
        cursor = span.end
    positions[:, cursor:] = torch.arange(current, current + prompt_len - cursor)
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta
