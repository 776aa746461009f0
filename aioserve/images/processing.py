"""The checkpoint's own image processor (its preprocessor_config.json,
through transformers), one image at a time -> a ProcessedImage: the
processor's tensors for that image alone, their content key, and the
tokens it takes. Blocking: it runs on the tokenizer's threads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from aioserve.hf_imports import HF_IMPORT_LOCK
from aioserve.image_inputs import ProcessedImage, content_key
from aioserve.images.errors import ImageError
from aioserve.images.family import VisionFamily


def load_hf_image_processor(folder: str | Path) -> Any:
    """AutoImageProcessor for the folder, its PIL form asked for by name:
    torchvision (the fast form's backend) is not a dependency, and asking
    keeps transformers from warning that it fell back. (transformers 5
    names the form `backend`; 4.x took use_fast=False.)"""
    import transformers

    with HF_IMPORT_LOCK:
        from transformers import AutoImageProcessor

        major = int(transformers.__version__.split(".")[0])
        form: dict[str, Any] = {"backend": "pil"} if major >= 5 else {"use_fast": False}
        try:
            return AutoImageProcessor.from_pretrained(str(folder), **form)
        except (TypeError, ValueError):  # a transformers 5 from before the `backend` argument
            return AutoImageProcessor.from_pretrained(str(folder), use_fast=False)


class ImageProcessor:
    def __init__(self, hf_processor: Any, family: VisionFamily) -> None:
        self.hf = hf_processor
        self.family = family
        family.configure_processor(hf_processor)
        merge = getattr(hf_processor, "merge_size", None)
        expected = getattr(family, "merge", None)
        if merge is not None and expected is not None and merge != expected:
            raise ValueError(
                f"the image processor merges {merge}x{merge} patches, the vision encoder {expected}x{expected} "
                "(preprocessor_config.json's merge_size against config.json's spatial_merge_size)"
            )

    def __call__(self, image: Image.Image) -> ProcessedImage:
        try:
            out = self.hf(images=[image], return_tensors="pt")
        except ValueError as exc:  # what the processor will not take (Qwen: an aspect ratio past 200)
            raise ImageError(f"the model's image processor refused the image: {exc}") from None
        tensors = {name: out[name].contiguous() for name in self.family.tensor_names}
        num_tokens, grid = self.family.measure(tensors)
        return ProcessedImage(key=content_key(tensors), tensors=tensors, num_tokens=num_tokens, grid=grid)
