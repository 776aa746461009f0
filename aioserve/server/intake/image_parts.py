"""A request's images, as the routes give them (chat's image_url parts, the
Responses API's input_image parts, /generate's image_data), taken for a
vision-language model and refused for a text-only one; read, decoded and
processed (aioserve/images) with each failure a 400 naming its part; and a
prompt's placeholders expanded to the images' tokens."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aioserve.image_inputs import ProcessedImage, PromptImages
from aioserve.images import ImageError, ImageIntake
from aioserve.images.prompt import PlaceholderMismatch, stray_image_tokens
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.openai_requests import ChatMessage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # where the request gave it: messages.0.content.1.image_url, image_data.2


def chat_image_refs(messages: Sequence[ChatMessage]) -> list[ImageRef]:
    return [
        ImageRef(part.url, f"messages.{m}.content.{number}.image_url")
        for m, message in enumerate(messages)
        for number, part in message.image_parts
    ]


def generate_image_refs(image_data: Any, num_prompts: int, batch: bool) -> list[list[ImageRef]]:
    """SGLang's image_data -> each prompt's images. One prompt: an image or
    a list of them; a batch: one entry per prompt (an image, a list, or
    null). An empty value asks for nothing."""
    if image_data in (None, "", []):
        return [[] for _ in range(num_prompts)]
    if not batch:
        urls = [image_data] if isinstance(image_data, str) else image_data
        if any(not isinstance(url, str) for url in urls):
            raise APIError("image_data for one prompt is an image (a URL or a data URL) or a list of them",
                           param="image_data")
        single = isinstance(image_data, str)
        return [[ImageRef(url, "image_data" if single else f"image_data.{k}") for k, url in enumerate(urls)]]
    if not isinstance(image_data, list) or len(image_data) != num_prompts:
        count = len(image_data) if isinstance(image_data, list) else 1
        raise APIError(f"image_data has {count} entries for {num_prompts} prompts: give one per prompt "
                       "(an image, a list of them, or null)", param="image_data")
    refs: list[list[ImageRef]] = []
    for p, entry in enumerate(image_data):
        if entry is None:
            refs.append([])
        elif isinstance(entry, str):
            refs.append([ImageRef(entry, f"image_data.{p}")])
        else:
            refs.append([ImageRef(url, f"image_data.{p}.{k}") for k, url in enumerate(entry)])
    return refs


def refuse_chat_images(ctx: ServingContext, messages: Sequence[ChatMessage]) -> None:
    """A text-only model: a 400 at the first message with an image part,
    worded as before images were taken at all."""
    if ctx.images is not None:
        return
    for m, message in enumerate(messages):
        for number, _ in message.image_parts:
            raise APIError(
                f"this model takes text only: content part {number} has type 'image_url', and only 'text' "
                f"parts are supported (`{ctx.model_name}` is not a vision-language model)",
                param=f"messages.{m}.content",
            )


def intake_for(ctx: ServingContext, refs: Sequence[ImageRef], field: str) -> ImageIntake:
    """The server's image intake, for a prompt of these images: a 400 when
    the model takes text only (naming `field`) or the prompt holds more
    images than --limit-mm-per-prompt allows (naming the first past it)."""
    intake = ctx.images
    if intake is None:
        raise APIError(
            f"{field} is not supported: this model takes text only (`{ctx.model_name}` is not a "
            "vision-language model)", param=field,
        )
    if len(refs) > intake.max_images:
        raise APIError(
            f"this prompt holds {len(refs)} images, more than this server's limit of {intake.max_images} per "
            "prompt (--limit-mm-per-prompt)", param=refs[intake.max_images].param, code="too_many_images",
        )
    return intake


async def load_images(intake: ImageIntake, refs: Sequence[ImageRef]) -> list[ProcessedImage]:
    """Every image read, decoded and processed off the loop; the first that
    fails is a 400 naming its part."""
    try:
        return await intake.load([ref.url for ref in refs])
    except ImageError as exc:
        param = refs[exc.index].param if exc.index is not None else None
        logger.debug("image refused (%s): %s", param, exc.message)
        raise APIError(exc.message, param=param, code="invalid_image") from None


async def expand(
    intake: ImageIntake, ids: list[int], images: list[ProcessedImage], param: str, source: str,
) -> tuple[list[int], PromptImages]:
    """The prompt's placeholders expanded; a count that does not match is a
    400 naming `param`, saying what `source` (where the placeholders come
    from) should have held."""
    try:
        return await intake.expand(ids, images)
    except PlaceholderMismatch as exc:
        raise APIError(
            f"{exc.message}: {source} (one {intake.family.marker} per image, in order)", param=param,
        ) from None


async def with_images(
    ctx: ServingContext, encode: Callable[[], Awaitable[list[int]]], refs: Sequence[ImageRef], field: str,
    param: str, source: str,
) -> tuple[list[int], PromptImages | None]:
    """A prompt's ids (`encode`: tokenizing, which fails fast on a bad
    template) while its images load beside it; then its placeholders
    expanded. Without images, the ids alone. `field`: what a text-only model
    refuses; `param`: what a placeholder count that does not match blames."""
    if not refs:
        return await encode(), None
    intake = intake_for(ctx, refs, field)
    loading = asyncio.ensure_future(load_images(intake, refs))
    try:
        ids = await encode()
        images = await loading
    finally:
        if not loading.done():
            loading.cancel()  # the prompt failed: the fetches stop
        elif not loading.cancelled():
            loading.exception()  # read, so that asyncio does not log it as lost
    return await expand(intake, ids, images, param, source)


def check_image_tokens(ctx: ServingContext, prompt_ids: list[int], images: PromptImages | None) -> None:
    """A prompt's image tokens must all be its images' runs: text or token
    ids that spell the model's image token (which no image would fill) are
    a 400 naming the prompt."""
    intake = ctx.images
    if intake is None:
        return
    found = stray_image_tokens(prompt_ids, images, intake.pad_id)
    if found is not None:
        expected = images.num_tokens if images is not None else 0
        raise APIError(
            f"the prompt holds {found} of the model's image tokens (id {intake.pad_id}) where its images fill "
            f"{expected}: image tokens come only from images (send images as image parts, or /generate's "
            "image_data)", param="prompt",
        )
