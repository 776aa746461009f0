"""Where each patch of a batch of images sits, for a Qwen2.5-VL-style
vision tower: its (row, col) in its image (the tower's 2-D rotary), the
order window attention visits the patches in, and which runs of that order
attend among themselves (each image frame whole, or each window).

A processor (Qwen2VLImageProcessor) emits an image's patches merge block by
merge block: the m*m patches that become one placeholder token are
consecutive. The tower permutes whole merge blocks into window order (the
blocks of one window consecutive, windows row by row, frame by frame,
image by image), runs every block in that order, and puts the merged
tokens back in the processor's order at the end.

Pure index arithmetic over the grids, computed once per encoder call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Segments:
    """Runs of a packed sequence that attend only among themselves, grouped
    by length: each group is one batched attention of n runs of L rows."""

    groups: list[torch.Tensor]  # each [n, L] int64: the rows of n runs of L rows

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device) -> "Segments":
        starts: dict[int, list[int]] = {}
        offset = 0
        for length in lengths:
            if length:
                starts.setdefault(length, []).append(offset)
            offset += length
        groups = [
            torch.tensor(firsts, dtype=torch.long, device=device)[:, None] + torch.arange(length, device=device)
            for length, firsts in starts.items()
        ]
        return cls(groups)


@dataclass
class ImageBatchLayout:
    """The patches of a batch of images, laid out for one tower pass."""

    patch_order: torch.Tensor  # [patches] int64: the processor's patch index at each row of the tower's order
    unit_order: torch.Tensor  # [units] int64: the merge block (placeholder token) at each merged row
    positions: torch.Tensor  # [patches, 2] int64: (row, col) of each row's patch in its image, tower order
    full: Segments  # each image frame whole (the full-attention blocks)
    windows: Segments  # each window (the other blocks)
    tokens_per_image: list[int]  # placeholder tokens (merge blocks) of each image, in the processor's order


def _patch_rows_cols(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of a frame's h x w patches in the processor's order: merge
    block by merge block, blocks row-major, patches row-major inside."""
    block_row = torch.arange(h // merge).view(-1, 1, 1, 1)
    block_col = torch.arange(w // merge).view(1, -1, 1, 1)
    inner_row = torch.arange(merge).view(1, 1, -1, 1)
    inner_col = torch.arange(merge).view(1, 1, 1, -1)
    shape = (h // merge, w // merge, merge, merge)
    rows = (block_row * merge + inner_row).expand(shape).flatten()
    cols = (block_col * merge + inner_col).expand(shape).flatten()
    return rows, cols


def _window_order(t: int, h: int, w: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of a t x h x w grid (of blocks) in window order, and
    each window's block count. Windows are side x side blocks, tiled from
    the top left (the last row and column of windows may be cut short)."""
    ids = torch.arange(t * h * w).view(t, h, w)
    pad_h, pad_w = -h % side, -w % side
    padded = F.pad(ids, (0, pad_w, 0, pad_h), value=-1)
    across, down = (w + pad_w) // side, (h + pad_h) // side
    blocks = padded.view(t, down, side, across, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
    valid = blocks >= 0
    return blocks[valid], valid.sum(dim=1).tolist()


def image_batch_layout(
    grids: Sequence[Sequence[tuple[int, int, int]]], merge: int, window_blocks: int, device: torch.device
) -> ImageBatchLayout:
    """The layout of images given as their grids (time, height, width in
    patches; an image may hold several, as a processor's image_grid_thw
    rows), `merge` patches per side per token, windows of `window_blocks`
    merge blocks per side."""
    unit = merge * merge
    unit_orders: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    full_lengths: list[int] = []
    window_lengths: list[int] = []
    tokens_per_image: list[int] = []
    units = 0
    for image in grids:
        image_tokens = 0
        for t, h, w in image:
            if h % merge or w % merge:
                raise ValueError(f"an image grid of {h} x {w} patches is not whole {merge} x {merge} blocks")
            order, windows = _window_order(t, h // merge, w // merge, max(window_blocks, 1))
            rows, cols = _patch_rows_cols(h, w, merge)
            frame = torch.stack((rows, cols), dim=1).repeat(t, 1)  # [t*h*w, 2], processor order
            patch_in_grid = (order[:, None] * unit + torch.arange(unit)).flatten()
            positions.append(frame[patch_in_grid])
            unit_orders.append(order + units)
            full_lengths += [h * w] * t
            window_lengths += [n * unit for n in windows]
            units += t * (h // merge) * (w // merge)
            image_tokens += t * (h // merge) * (w // merge)
        tokens_per_image.append(image_tokens)
    unit_order = torch.cat(unit_orders)
    patch_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()
    return ImageBatchLayout(
        patch_order=patch_order.to(device),
        unit_order=unit_order.to(device),
        positions=torch.cat(positions).to(device),
        full=Segments.from_lengths(full_lengths, device),
        windows=Segments.from_lengths(window_lengths, device),
        tokens_per_image=tokens_per_image,
    )
