"""Images between intake and the engine, without a model: the prefix cache's
keys, M-RoPE positions, the scheduler's encoder cache table (what the
engine encodes, keeps and evicts) and chunk ends around images that attend
both ways."""

from __future__ import annotations

import torch

from aioserve.batch_plan import ImageRows
from aioserve.image_inputs import IMAGE_CACHE_ID_BASE, ImageSpan, ProcessedImage, PromptImages, content_key, mrope_positions
from aioserve.scheduler.encoder_cache import EncoderCacheTable
from aioserve.scheduler.planner import whole_images_end

PAD = 7  # the placeholder token id in these prompts


def image(seed: int, grid: tuple[int, int, int] = (1, 2, 3)) -> ProcessedImage:
    pixels = torch.randn(4 * grid[1] * grid[2], 12, generator=torch.Generator().manual_seed(seed))
    tensors = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[grid[0], 2 * grid[1], 2 * grid[2]]])}
    return ProcessedImage(content_key(tensors), tensors, grid[0] * grid[1] * grid[2], grid)


def prompt_with(*images: ProcessedImage, text: int = 3) -> tuple[list[int], PromptImages]:
    ids: list[int] = []
    spans = []
    for img in images:
        ids += list(range(100, 100 + text))
        spans.append(ImageSpan(img, len(ids)))
        ids += [PAD] * img.num_tokens
    ids += list(range(200, 200 + text))
    mrope, delta = mrope_positions(len(ids), spans)
    return ids, PromptImages(spans, mrope, delta)


def test_content_key_follows_the_pixels() -> None:
    assert image(1).key == image(1).key
    assert image(1).key != image(2).key
    assert 0 <= image(1).key < 2**62


def test_cache_ids_tell_images_apart_and_keep_text() -> None:
    ids_a, a = prompt_with(image(1))
    ids_b, b = prompt_with(image(2))
    assert ids_a == ids_b  # the same placeholders...
    keys_a, keys_b = a.cache_ids(ids_a), b.cache_ids(ids_b)
    assert keys_a != keys_b  # ...but different images
    assert keys_a == prompt_with(image(1))[1].cache_ids(ids_a)
    span = a.spans[0]
    assert keys_a[: span.offset] == ids_a[: span.offset] and keys_a[span.end :] == ids_a[span.end :]
    assert all(k >= IMAGE_CACHE_ID_BASE for k in keys_a[span.offset : span.end])


def test_mrope_positions_walk_the_grid_and_text_runs_on() -> None:
    ids, images = prompt_with(image(1, grid=(1, 2, 3)), text=2)
    assert images.mrope is not None
    # text 0,1; image at start 2: t=2, h=2+row, w=2+col; text resumes at 2 + max(2, 3) = 5
    assert images.mrope[:, :2].tolist() == [[0, 1]] * 3
    assert images.mrope[0, 2:8].tolist() == [2] * 6
    assert images.mrope[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert images.mrope[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert images.mrope[:, 8:].tolist() == [[5, 6]] * 3
    assert images.rope_delta == 7 - len(ids)
    # a generated token's positions: its index plus the delta, on every axis
    assert images.positions(len(ids), len(ids) + 2).tolist() == [[7, 8]] * 3


def test_one_encode_for_two_requests_and_holds_across_chunks() -> None:
    table = EncoderCacheTable()
    shared = image(1, grid=(1, 2, 2))  # 4 tokens
    _, a = prompt_with(shared)
    _, b = prompt_with(shared)
    span = a.spans[0]
    # request a computes up to the middle of its image, b all of it, in one step
    table.add_chunk("a", a.spans, 0, span.offset + 2, first_row=0)
    table.add_chunk("b", b.spans, 0, b.spans[0].end, first_row=10)
    step = table.take()
    assert step is not None and [e.key for e in step.encode] == [shared.key] and step.evict == []
    assert step.rows == [ImageRows(span.offset, shared.key, 0, 2), ImageRows(10 + span.offset, shared.key, 0, 4)]
    assert table.held == {shared.key: {"a"}}
    # a's next chunk finishes the image: no encode, and it is evicted with the next plan
    table.add_chunk("a", a.spans, span.offset + 2, span.end + 3, first_row=0)
    step = table.take()
    assert step is not None and step.encode == [] and step.rows == [ImageRows(0, shared.key, 2, 2)]
    assert table.held == {}
    step = table.take()
    assert step is not None and step.evict == [shared.key] and step.rows == []
    assert table.take() is None


def test_an_aborted_request_gives_its_images_back() -> None:
    table = EncoderCacheTable()
    _, images = prompt_with(image(3), image(4))
    table.add_chunk("r", images.spans, 0, images.spans[0].offset + 1, first_row=0)
    assert table.take() is not None and len(table) == 1
    table.release("r")
    assert len(table) == 0 and table.by_request == {}
    step = table.take()
    assert step is not None and step.evict == [images.spans[0].image.key]


def test_an_evicted_image_wanted_again_before_the_next_plan_is_kept() -> None:
    table = EncoderCacheTable()
    img = image(5)
    _, images = prompt_with(img)
    table.add_chunk("r", images.spans, 0, images.spans[0].end, first_row=0)
    table.take()
    # released by the chunk above; another request wants it in the next step
    table.add_chunk("s", images.spans, 0, images.spans[0].end, first_row=0)
    step = table.take()
    assert step is not None and step.encode == [] and step.evict == []  # the engine still has it


def test_chunks_never_cut_an_image_that_attends_both_ways() -> None:
    img = image(6, grid=(1, 2, 4))  # 8 tokens at offset 3
    span = ImageSpan(img, 3, bidirectional=True)
    images = PromptImages([span])
    assert whole_images_end(images, 0, 5) == 3  # stops before it
    assert whole_images_end(images, 0, 11) == 11  # takes it whole
    assert whole_images_end(images, 5, 7) == 11  # started in it (a cached prefix): the rest, past the budget
    causal = PromptImages([ImageSpan(img, 3)])
    assert whole_images_end(causal, 0, 5) == 5  # a causal image may be cut
