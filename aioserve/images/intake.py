"""What the server holds for a vision-language model: its family, its image
processor and the bounds, and the async steps a request's images take,
none of them on the event loop: reading the bytes on the media threads
(fetches may wait on the network for seconds), decoding and processing on
the tokenizer's threads (CPU work, as tokenizing is), expanding a prompt's
placeholders there too (a long prompt's ids and M-RoPE positions)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aioserve.config import ConfigError
from aioserve.image_inputs import ProcessedImage, PromptImages
from aioserve.images.decode import decode_image
from aioserve.images.errors import ImageError
from aioserve.images.family import TokenLookup, VisionFamily
from aioserve.images.http_fetch import GuardedFetch
from aioserve.images.processing import ImageProcessor, load_hf_image_processor
from aioserve.images.prompt import expand_images
from aioserve.images.registry import family_class, read_config
from aioserve.images.settings import MediaSettings
from aioserve.images.sources import ImageBytes, read_source, scheme_of

logger = logging.getLogger(__name__)

Result = TypeVar("Result")

# The loop's own wait on a fetch outlasts the fetch's deadline by this much:
# the fetch thread reports its own timeout first, with its reason; the
# loop's is for a thread stuck where no socket timeout reaches (DNS).
LOOP_GRACE_S = 1.0


class WorkRunner(Protocol):
    """Runs blocking work on a thread pool (the tokenizer's run_async)."""

    def __call__(self, work: Callable[..., Result], *args: Any) -> Any: ...


class ImageIntake:
    def __init__(
        self, family: VisionFamily, processor: ImageProcessor, settings: MediaSettings,
        run_cpu: WorkRunner, media_pool: Executor,
    ) -> None:
        self.family = family
        self.processor = processor
        self.settings = settings
        self.run_cpu = run_cpu
        self.media_pool = media_pool

    @property
    def max_images(self) -> int:
        return self.settings.max_images

    # -- one image ---------------------------------------------------------------------------

    async def read(self, url: str) -> ImageBytes:
        """The bytes behind a URL, on the media threads; an http(s) fetch is
        aborted when its deadline passes or the request is cancelled."""
        loop = asyncio.get_running_loop()
        if scheme_of(url) not in ("http", "https"):
            return await loop.run_in_executor(self.media_pool, read_source, url, self.settings)
        fetch = GuardedFetch(url, self.settings)
        future = loop.run_in_executor(self.media_pool, read_source, url, self.settings, fetch)
        try:
            return await asyncio.wait_for(future, self.settings.fetch_timeout + LOOP_GRACE_S)
        except asyncio.TimeoutError:
            fetch.abort()
            raise fetch.timeout_error() from None
        except asyncio.CancelledError:
            fetch.abort()
            raise

    def prepare(self, source: ImageBytes) -> ProcessedImage:
        """Decode and process one image (blocking: the tokenizer's threads)."""
        settings = self.settings
        image = decode_image(source.data, settings.max_image_bytes, settings.max_image_pixels, source.content_type)
        return self.processor(image)

    async def load_one(self, url: str) -> ProcessedImage:
        source = await self.read(url)
        return await self.run_cpu(self.prepare, source)

    # -- a prompt's images ----------------------------------------------------------------------

    async def load(self, urls: Sequence[str]) -> list[ProcessedImage]:
        """Every image of a prompt, read and processed at once. The first
        failure (by position) raises its ImageError with `index` set, and the
        others are cancelled (their fetches aborted)."""
        tasks = [asyncio.ensure_future(self.load_one(url)) for url in urls]
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:  # a failure, or this request cancelled: nothing left running
                task.cancel()
        failures = [  # each one's exception retrieved, lest asyncio log the unread ones
            (index, error) for index, task in enumerate(tasks)
            if task.done() and not task.cancelled() and (error := task.exception()) is not None
        ]
        if failures:
            index, error = failures[0]
            if isinstance(error, ImageError):
                error.index = index
            raise error
        return [task.result() for task in tasks]

    async def expand(self, ids: list[int], images: Sequence[ProcessedImage]) -> tuple[list[int], PromptImages]:
        """The prompt's placeholders expanded (prompt.py), on the tokenizer's threads."""
        result: tuple[list[int], PromptImages] = await self.run_cpu(expand_images, ids, images, self.family)
        return result

    @property
    def pad_id(self) -> int:
        return self.family.tokens.pad_id

    def shutdown(self) -> None:
        self.media_pool.shutdown(wait=False, cancel_futures=True)


def load_image_intake(
    folder: str | Path, settings: MediaSettings, run_cpu: WorkRunner, media_pool: Callable[[], Executor],
    token_id: TokenLookup,
) -> ImageIntake | None:
    """The intake of the checkpoint in `folder`, or None when it takes text
    only (its architecture is no vision-language family's, or its folder has
    no image processor's config: logged). `media_pool`
    makes the threads that read images (only for a model that takes them).
    A vision-language checkpoint without a usable image processor cannot
    be served with images: a ConfigError."""
    config = read_config(folder)
    family_type = family_class(config)
    if family_type is None:
        return None
    if not (Path(folder) / "preprocessor_config.json").is_file():
        # Its text still serves (a folder copied without the processor's file):
        # image parts are then refused as for a text model.
        logger.warning("%s is a %s checkpoint without a preprocessor_config.json: serving text only, images refused",
                       folder, family_type.name)
        return None
    try:
        family = family_type.from_config(config, token_id)
        processor = ImageProcessor(load_hf_image_processor(folder), family)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder} is a {family_type.name} checkpoint, and its images cannot be read: {exc}") from exc
    logger.info("images: %s, up to %d per prompt", family.name, settings.max_images)
    return ImageIntake(family, processor, settings, run_cpu, media_pool())
