"""The offline API's images (LLM.chat, LLM.generate): OpenAI chat parts
(`image_url` with a URL or a data URL, vLLM's `image_pil` with a PIL image)
and vLLM's `multi_modal_data={"image": ...}` beside a prompt that holds the
model's image marker once per image. URLs are read with the server's
guards (intake.load, on the caller's event loop); a PIL image is the
caller's own and goes straight to the processor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image

from aioserve.image_inputs import ProcessedImage, PromptImages
from aioserve.images.intake import ImageIntake
from aioserve.images.prompt import expand_images

# A conversation's messages, rendered and tokenized: (messages, rewrite of the text) -> ids.
ChatEncoder = Callable[[list[dict[str, Any]], Callable[[str], str] | None], list[int]]


class OfflineImages:
    def __init__(self, intake: ImageIntake, loop: asyncio.AbstractEventLoop) -> None:
        self.intake = intake
        self.loop = loop

    def _process(self, sources: Sequence[str | Image.Image]) -> list[ProcessedImage]:
        if len(sources) > self.intake.max_images:
            raise ValueError(f"{len(sources)} images in one prompt, more than the limit of {self.intake.max_images}")
        urls = [s for s in sources if isinstance(s, str)]
        read = iter(self.loop.run_until_complete(self.intake.load(urls)) if urls else [])
        return [next(read) if isinstance(s, str) else self.intake.processor(s.convert("RGB")) for s in sources]

    def chat(self, messages: list[dict[str, Any]], encode: ChatEncoder) -> tuple[list[int], PromptImages | None]:
        """A conversation's ids and images: each image part becomes the
        template's `{"type": "image"}`, its image read and processed."""
        sources: list[str | Image.Image] = []
        templated = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                templated.append(message)
                continue
            parts = []
            for part in content:
                source = image_source(part)
                if source is None:
                    parts.append(part)
                else:
                    sources.append(source)
                    parts.append({"type": "image"})
            templated.append({**message, "content": parts})
        if not sources:
            return encode(messages, None), None
        ids = encode(templated, self.intake.family.rewrite_text)
        return expand_images(ids, self._process(sources), self.intake.family)

    def prompt(self, ids: list[int], images: Sequence[str | Image.Image]) -> tuple[list[int], PromptImages]:
        """A prompt's ids with its markers expanded to `images` (vLLM's multi_modal_data)."""
        return expand_images(ids, self._process(images), self.intake.family)


def image_source(part: Any) -> str | Image.Image | None:
    """An image part's URL or PIL image (None: not an image part)."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if part.get("type") == "image_pil":
        return part.get("image_pil")
    return None
