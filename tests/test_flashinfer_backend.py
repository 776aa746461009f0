"""The FlashInfer backend's CPU-side seams: the paged arrays it plans with,
the fallback when FlashInfer cannot serve, and the whole backend (planning,
routing decodes and extends to their wrappers, graph buffers) run against
tests/fake_flashinfer.py, a torch rendering of the two wrappers, with the
greedy tokens required to equal the torch_native reference's. The real
kernels are checked on a GPU (tests/test_gpu_fast_path.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.attention import create_backend
from aioserve.attention.backend import AttentionShape
from aioserve.attention.flashinfer import FlashInferBackend
from aioserve.flashinfer.paged_args import paged_kv_args, qo_indptr, window_left
from aioserve.attention.torch_native import kv_slots
from aioserve.engine.cuda_graph import EagerCapture
from aioserve.kvcache.kv_pool import KVPool
from aioserve.cpu.native import cpu_kernels
from fake_flashinfer import fake_flashinfer
from hf_reference import hf_encode
from tiny_models import build_checkpoint

TEXTS = ["Once upon a time", "The cat sat on the", "1 2 3 4 5 6 7 8 9", "hello world " * 6, "a b c"]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_arrays_name_the_slots_the_torch_backend_reads(page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size)
    seq_lens = torch.tensor([1, page_size, page_size + 1, 5 * page_size - 1, 37])
    width = int((seq_lens.max() + page_size - 1) // page_size) + 2  # wider than needed, as plans are
    page_table = torch.randperm(500, generator=gen)[: 5 * width].view(5, width).to(torch.int32) + 1
    args = paged_kv_args(page_table, seq_lens, page_size)
    assert args.indptr.dtype == args.indices.dtype == args.last_page_len.dtype == torch.int32
    assert args.batch_size == 5 and int(args.indptr[-1]) == args.indices.numel()
    for i, length in enumerate(seq_lens.tolist()):
        pages = args.indices[args.indptr[i] : args.indptr[i + 1]].long()
        last = int(args.last_page_len[i])
        assert 1 <= last <= page_size
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[: (len(pages) - 1) * page_size + last]
        assert torch.equal(slots, kv_slots(page_table[i : i + 1], length, page_size)[0])


def test_query_offsets_and_window() -> None:
    assert qo_indptr(torch.tensor([3, 1, 5])).tolist() == [0, 3, 4, 9]
    assert window_left(None) == -1 and window_left(24) == 23
    with pytest.raises(ValueError):
        paged_kv_args(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]), 4)


def test_flashinfer_needs_cuda_and_auto_falls_back() -> None:
    pool = KVPool(2, 4, 4, 2, 8, torch.float32, torch.device("cpu"))
    shape = AttentionShape(4, 2, 8, (None, None), torch.float32)
    with pytest.raises(ValueError, match="needs CUDA"):
        create_backend("flashinfer", pool, shape)
    assert create_backend("auto", pool, shape).name == "torch_native"
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("flash", pool, shape)


def _run(model: Path, prompts: list[list[int]], fake: bool, graphs: bool, **options) -> list[list[int]]:
    llm = LLM(str(model), debug_integrity=True, **options)
    engine = llm.engine
    try:
        if fake:
            engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake_flashinfer)
        if graphs:
            engine.graph_runner = engine.capture_decode_graphs(EagerCapture())
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        first = [o.token_ids for o in llm.generate(prompts, params)]
        # Again with a longer shared prefix: extends over cached pages.
        again = [o.token_ids for o in llm.generate([p + p[:5] for p in prompts], params)]
        if graphs:
            assert engine.graph_runner.replays > 0
        return first + again
    finally:
        llm.close()


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny fixtures at head_dim 64: the enforcing fake, like the real
    wrappers, has no kernel for the fixtures' 16 and 32."""
    root = tmp_path_factory.mktemp("hd64")
    return {arch: build_checkpoint(arch, root / arch, overrides={"head_dim": 64}) for arch in ("llama3-rope", "mistral", "qwen3")}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("arch", ["llama3-rope", "mistral", "qwen3"])  # mistral: GQA + sliding window 24
def test_flashinfer_backend_matches_torch_native(head_dim_64: dict[str, Path], arch: str, page_size: int) -> None:
    model = head_dim_64[arch]
    prompts = [hf_encode(model, t) for t in TEXTS]
    # Small prefill chunks: steps mix decodes with extends over a cached prefix.
    options = dict(page_size=page_size, max_prefill_tokens=16, dtype="float32")
    reference = _run(model, prompts, fake=False, graphs=False, **options)
    assert _run(model, prompts, fake=True, graphs=False, **options) == reference


@pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_graph_buffers_match_eager(head_dim_64: dict[str, Path], page_size: int) -> None:
    model = head_dim_64["mistral"]
    prompts = [hf_encode(model, t) for t in TEXTS]
    options = dict(page_size=page_size, dtype="float32", cuda_graph_max_bs=6, max_running_requests=8)
    reference = _run(model, prompts, fake=False, graphs=False, **options)
    assert _run(model, prompts, fake=True, graphs=True, **options) == reference


@pytest.mark.parametrize("window", [None, 4])
def test_image_rows_both_ways_match_torch_native(window) -> None:
    """Gemma 3's image rows attend both ways: the FlashInfer backend plans a
    custom mask (the fake checks its layout and applies it) and attends as
    torch_native does, beside a decode and a plain chunk."""
    from aioserve.batch_plan import BatchPlan, ImageBatch, ImageRows
    from aioserve.attention.torch_native import TorchNativeBackend

    page, heads, kv_heads, dim = 4, 4, 2, 64
    # a decode (KV 6), an extend of 9 after 4 cached with an image at rows 3..8 of it, a fresh chunk of 5
    seq_lens, extend_lens = [6, 13, 5], [1, 9, 5]
    width = 4
    rows = [[1 + r * width + p for p in range(width)] for r in range(3)]
    positions, slots = [], []
    for r, (total, new) in enumerate(zip(seq_lens, extend_lens)):
        for pos in range(total - new, total):
            positions.append(pos)
            slots.append(rows[r][pos // page] * page + pos % page)
    plan = BatchPlan(
        step=0, input_ids=torch.zeros(15, dtype=torch.long), positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(slots), seq_lens=torch.tensor(seq_lens), extend_lens=torch.tensor(extend_lens),
        page_table=torch.tensor(rows, dtype=torch.int32), num_decodes=1, logits_indices=torch.zeros(0, dtype=torch.long),
        sampling=None, images=ImageBatch([], [], [ImageRows(1 + 3, 5, 0, 6, bidirectional=True)]),
    )
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(15, heads, dim, generator=generator).to(torch.bfloat16)
    k = torch.randn(15, kv_heads, dim, generator=generator).to(torch.bfloat16)
    v = torch.randn(15, kv_heads, dim, generator=generator).to(torch.bfloat16)
    outs = []
    for make in (lambda pool: TorchNativeBackend(pool, use_native=False),
                 lambda pool: FlashInferBackend(pool, shape, fake_flashinfer)):
        pool = KVPool(1, 20, page, kv_heads, dim, torch.bfloat16, torch.device("cpu"))
        pool.buffer[:, :, page:].normal_(generator=torch.Generator().manual_seed(9))
        shape = AttentionShape(heads, kv_heads, dim, (window,), torch.bfloat16)
        outs.append(make(pool).prepare(plan, plan).attend(0, q.clone(), k, v, dim**-0.5, window))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=2e-2)
