"""An image part's URL -> the image's bytes, on a worker thread (never the
event loop's): a data URL decoded, an http(s) URL fetched (http_fetch.py),
a local file read from under --allowed-local-media-path. Each is held to
the byte cap; none touches what the settings do not allow."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from aioserve.images.errors import ImageError, shown
from aioserve.images.http_fetch import GuardedFetch
from aioserve.images.settings import MediaSettings


@dataclass(frozen=True)
class ImageBytes:
    data: bytes
    content_type: str  # what the source said the bytes are ("" if it did not): for error messages
    origin: str  # "data URL", "URL", "file"


def scheme_of(url: str) -> str:
    """The URL's scheme, lowercased ("" for a plain path)."""
    if url.startswith("/"):
        return ""
    return urlsplit(url[:64]).scheme.lower()  # the scheme only: a data URL's megabytes need no splitting


def read_data_url(url: str, settings: MediaSettings) -> ImageBytes:
    """data:[<media type>][;base64],<data>: base64 only (an image is binary)."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise ImageError("a data URL needs a comma before its data: data:image/png;base64,...")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if media_type and not media_type.startswith("image/") and media_type != "application/octet-stream":
        raise ImageError(f"the data URL holds {media_type!r}, not an image")
    if "base64" not in params[1:]:
        raise ImageError("an image's data URL must be base64: data:image/png;base64,...")
    payload = "".join(payload.split())  # line breaks some encoders insert
    if len(payload) // 4 * 3 > settings.max_image_bytes:
        raise ImageError(
            f"the data URL's image is about {len(payload) // 4 * 3} bytes, more than the limit of "
            f"{settings.max_image_bytes} (--max-image-bytes)"
        )
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 is malformed") from None
    return ImageBytes(data, media_type, "data URL")


def read_local_file(path_text: str, settings: MediaSettings) -> ImageBytes:
    """A file under --allowed-local-media-path: symlinks resolved, then the
    real path must lie under the real folder; only a regular file (a FIFO or
    a device would block or never end)."""
    if settings.allowed_local_path is None:
        raise ImageError(
            "local image files are not served: start the server with --allowed-local-media-path DIR to allow "
            "file:// URLs of files under DIR"
        )
    path = Path(path_text)
    if not path.is_absolute():
        raise ImageError(f"a local image path must be absolute: {shown(path_text)}")
    root = Path(settings.allowed_local_path).resolve()
    real = path.resolve()
    if not real.is_relative_to(root):
        raise ImageError(f"the image file {shown(path_text)} is outside --allowed-local-media-path")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ImageError(f"cannot open the image file {shown(path_text)}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ImageError(f"the image path {shown(path_text)} is not a regular file")
        if info.st_size > settings.max_image_bytes:
            raise ImageError(
                f"the image file is {info.st_size} bytes, more than the limit of {settings.max_image_bytes} "
                "(--max-image-bytes)"
            )
        data = file.read(settings.max_image_bytes + 1)
    if len(data) > settings.max_image_bytes:  # it grew since fstat
        raise ImageError(f"the image file is more than the limit of {settings.max_image_bytes} bytes")
    return ImageBytes(data, "", "file")


def file_url_path(url: str) -> str:
    """file:///abs/path (or file://localhost/abs/path) -> /abs/path."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"a file URL must name a local path (file:///...), not the host {parts.netloc!r}")
    return unquote(parts.path)


def read_source(url: str, settings: MediaSettings, fetch: GuardedFetch | None = None) -> ImageBytes:
    """The bytes behind an image part's URL. Blocking: run it on a worker
    thread. An http(s) URL is fetched by `fetch` (made by the caller, which
    may abort it), or a fetch of its own."""
    scheme = scheme_of(url)
    if scheme == "data":
        return read_data_url(url, settings)
    if scheme in ("http", "https"):
        fetched = (fetch or GuardedFetch(url, settings)).run()
        return ImageBytes(fetched.data, fetched.content_type, "URL")
    if scheme == "file":
        return read_local_file(file_url_path(url), settings)
    if scheme == "":
        return read_local_file(url, settings)
    raise ImageError(f"an image URL must be a data URL, http(s) or a local file; got the scheme {scheme!r}")
