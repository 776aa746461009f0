"""A prompt's image placeholders -> each image's run of tokens, and the
PromptImages the scheduler takes: where each image's run starts, and for an
M-RoPE family the prompt's three-axis positions."""

from __future__ import annotations

from collections.abc import Sequence

from aioserve.image_inputs import ImageSpan, ProcessedImage, PromptImages, mrope_positions
from aioserve.images.errors import ImageError
from aioserve.images.family import VisionFamily


class PlaceholderMismatch(ImageError):
    """The prompt's placeholders and its images do not pair up; the caller
    says what that means where the prompt came from (a chat template that
    does not place images, a raw prompt without the markers)."""

    def __init__(self, found: int, images: int) -> None:
        super().__init__(f"the prompt holds {found} image placeholders for {images} images")
        self.found = found
        self.images = images


def placeholder_offsets(ids: Sequence[int], placeholder_id: int) -> list[int]:
    found: list[int] = []
    ids = ids if isinstance(ids, list) else list(ids)
    try:
        while True:  # list.index runs in C: a long prompt is scanned fast
            found.append(ids.index(placeholder_id, found[-1] + 1 if found else 0))
    except ValueError:
        return found


def expand_images(
    ids: Sequence[int], images: Sequence[ProcessedImage], family: VisionFamily
) -> tuple[list[int], PromptImages]:
    """Each placeholder, in order, becomes its image's tokens. Raises
    PlaceholderMismatch unless there is exactly one placeholder per image."""
    tokens = family.tokens
    offsets = placeholder_offsets(ids, tokens.placeholder_id)
    if len(offsets) != len(images):
        raise PlaceholderMismatch(len(offsets), len(images))
    out: list[int] = []
    spans: list[ImageSpan] = []
    cursor = 0
    for offset, image in zip(offsets, images):
        out += ids[cursor:offset]
        run = [tokens.pad_id] * image.num_tokens
        before, after, in_place = tokens.before, tokens.after, 0
        if before[-1:] == (tokens.placeholder_id,) and ids[offset + 1 : offset + 1 + len(run)] == run:
            # The run is in place already (family.rewrite_text wrote it into the text): keep it.
            before, after, in_place = (tokens.placeholder_id,), (), len(run)
        out += before
        spans.append(ImageSpan(image, len(out), bidirectional=family.bidirectional))
        out += run
        out += after
        cursor = offset + 1 + in_place
    out += ids[cursor:]
    prompt_images = PromptImages(spans)
    if family.mrope:
        prompt_images.mrope, prompt_images.rope_delta = mrope_positions(len(out), prompt_images.spans)
    return out, prompt_images


def stray_image_tokens(ids: Sequence[int], images: PromptImages | None, pad_id: int) -> int | None:
    """The count of image tokens in a prompt that its images do not account
    for (a raw prompt or text that spells <|image_pad|>, which no image
    fills), or None when they all are its images'."""
    found = ids.count(pad_id)
    expected = images.num_tokens if images is not None else 0
    return None if found == expected else found
