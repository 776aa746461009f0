"""The bounds every image is held to, from the server's flags."""

from __future__ import annotations

from dataclasses import dataclass

from aioserve.config import ServerArgs, images_per_prompt

MAX_REDIRECTS = 3  # hops an image URL may take (each one checked as the first)


@dataclass(frozen=True)
class MediaSettings:
    max_images: int = 16  # per prompt (--limit-mm-per-prompt)
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 50_000_000
    fetch_timeout: float = 5.0  # seconds for one URL, redirects included
    max_redirects: int = MAX_REDIRECTS
    allow_private_urls: bool = False  # loopback, private and link-local hosts (tests serve images locally)
    allowed_local_path: str | None = None  # the folder local files may come from (None: no local files)

    @classmethod
    def from_args(cls, args: ServerArgs) -> MediaSettings:
        return cls(
            max_images=images_per_prompt(args.limit_mm_per_prompt),
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            fetch_timeout=args.media_fetch_timeout,
            allow_private_urls=args.allow_private_media_urls,
            allowed_local_path=args.allowed_local_media_path,
        )
