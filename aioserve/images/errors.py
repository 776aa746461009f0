"""The one error of a client's image."""

from __future__ import annotations


class ImageError(ValueError):
    """An image a request gave cannot be used (unreachable, too large, not
    an image, refused by the model's processor): a 400. `index` is the
    image's place among those it was loaded with, set by ImageIntake.load."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.index = index


def shown(url: str, limit: int = 80) -> str:
    """A URL as an error message quotes it: a data URL's megabytes cut short."""
    return url if len(url) <= limit else url[:limit] + "..."
