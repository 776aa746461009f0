"""The engine's side of images: each image's embeddings, kept by key while
the scheduler says a request still needs them (scheduler/encoder_cache.py
makes the same decisions for every rank; the plan carries them), and the
step's image rows gathered from them.

The vision encoder runs here, inside the step, on the step's device: one
pass over every image the step encodes. Every tensor-parallel rank holds
the whole encoder and encodes the same images (the tower is small beside
the decoder, and its output is then on every rank without a collective).
"""

from __future__ import annotations

import logging

import torch

from aioserve.batch_plan import ImageBatch
from aioserve.models.causal_lm import ImageEmbeds, VisionLanguageModel

logger = logging.getLogger(__name__)


class ImageEmbeddings:
    def __init__(self, model: VisionLanguageModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.by_key: dict[int, torch.Tensor] = {}  # image key -> [its tokens, hidden]

    def __len__(self) -> int:
        return len(self.by_key)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.by_key.values())

    def step(self, batch: ImageBatch) -> ImageEmbeds | None:
        """Apply the plan's evictions, encode its new images, and return the
        rows of the step that take image embeddings with those embeddings."""
        for key in batch.evict:
            self.by_key.pop(key, None)
        if batch.encode:
            inputs = [
                {name: t.to(self.device, non_blocking=True) for name, t in zip(image.names, image.tensors)}
                for image in batch.encode
            ]
            for image, embeds in zip(batch.encode, self.model.encode_images(inputs)):
                self.by_key[image.key] = embeds
        if not batch.rows:
            return None
        missing = {r.key for r in batch.rows} - self.by_key.keys()
        if missing:  # the scheduler's table and this one disagree: a bug, not bad input
            raise RuntimeError(f"image embeddings not held: {sorted(missing)}")
        values = torch.cat([self.by_key[r.key][r.first:r.first + r.length] for r in batch.rows])
        return batch.row_indices().to(self.device, non_blocking=True), values
