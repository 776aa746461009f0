"""Image bytes -> an RGB PIL image, with the guards a client's file needs:
the byte cap, a pixel cap read from the header before anything is decoded
(a decompression bomb, a GIF whose logical screen is huge, is refused
unread), a clear error for what is truncated or not an image at all, and
the first frame of an animation. Blocking: run it on a worker thread."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from aioserve.images.errors import ImageError

# What OpenAI takes (PNG, JPEG, WebP, GIF), with BMP. (Pillow's JPEG opener
# also opens MPO, the JPEG a phone's camera writes.) Formats past these
# (TIFF, PSD, EPS and the rest) are more decoder surface than a chat request
# needs.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# Transparent pixels are laid on white, as vLLM does (dropping the alpha
# channel would show whatever color the transparent pixels hold, often black).
BACKGROUND = (255, 255, 255)

# Pillow warns when an image passes its own pixel bound; ours (checked from
# the header below) decides instead. Set once here: catch_warnings around
# each call would not be thread-safe.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def decode_image(data: bytes, max_bytes: int, max_pixels: int, content_type: str = "") -> Image.Image:
    """`content_type`: what the source said it sent, named when the bytes are not an image."""
    if len(data) > max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, more than the limit of {max_bytes} (--max-image-bytes)")
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:  # past twice Pillow's own bound: refused from its header too
        raise ImageError(f"the image has more than {max_pixels} pixels (--max-image-pixels): {exc}") from None
    except Image.UnidentifiedImageError:
        served = f" (served as {content_type})" if content_type and not content_type.startswith("image/") else ""
        raise ImageError(f"the data is not an image this server reads ({', '.join(FORMATS)}){served}") from None
    except Exception as exc:  # noqa: BLE001 - a malformed header; Pillow raises many kinds
        raise ImageError(f"the image cannot be read: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"the image is {width}x{height}, {width * height} pixels, more than the limit of {max_pixels} "
            "(--max-image-pixels)"
        )
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width}x{height}: it has no pixels")
    try:
        image.seek(0)  # an animation's first frame
        image.load()
        return to_rgb(image)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data: Pillow raises OSError, SyntaxError, ...
        raise ImageError(f"the {image.format} image cannot be decoded (truncated or corrupt?): {exc}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, BACKGROUND)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
