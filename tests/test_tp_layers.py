"""Each parallel layer, sharded over 2 gloo ranks (real processes, real
collectives), computes what the unsharded layer computes; and a rank reads
only its own slices of the checkpoint."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from aioserve.tp import distributed
from aioserve.tp.distributed import TPGroup, all_gather_last_dim, tp_group_as
from aioserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aioserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

HIDDEN, HEAD_DIM, TOKENS = 32, 8, 5
TOL = dict(atol=1e-5, rtol=1e-5)


def _full_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "x": r(TOKENS, HIDDEN),
        "col_w": r(48, HIDDEN), "col_b": r(48),
        "gate": r(64, HIDDEN), "up": r(64, HIDDEN),
        "q": r(4 * HEAD_DIM, HIDDEN), "k2": r(2 * HEAD_DIM, HIDDEN), "v2": r(2 * HEAD_DIM, HIDDEN),
        "q_b": r(4 * HEAD_DIM),
        "k1": r(HEAD_DIM, HIDDEN), "v1": r(HEAD_DIM, HIDDEN),
        "row_w": r(HIDDEN, 48), "row_b": r(HIDDEN), "row_x": r(TOKENS, 48),
        "embed": r(37, HIDDEN),  # 37 rows: does not divide over 2 ranks
        "ids": torch.tensor([0, 5, 18, 19, 36, 20]),
    }


def _qkv(w: dict[str, torch.Tensor], kv_heads: int) -> QKVParallelLinear:
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, kv_heads, bias=True)
    k, v = (w["k2"], w["v2"]) if kv_heads == 2 else (w["k1"], w["v1"])
    layer.load_weight("weight", w["q"], "q")
    layer.load_weight("weight", k, "k")
    layer.load_weight("weight", v, "v")
    layer.load_weight("bias", w["q_b"], "q")
    layer.load_weight("bias", torch.zeros(kv_heads * HEAD_DIM), "k")
    layer.load_weight("bias", torch.zeros(kv_heads * HEAD_DIM), "v")
    return layer


def _check_rank(rank: int, size: int, w: dict[str, torch.Tensor]) -> None:
    """Runs on every rank: sharded layers against the full math."""
    x = w["x"]
    # Column-parallel: this rank's output columns; gathered they are the full output.
    col = ColumnParallelLinear(HIDDEN, 48, bias=True)
    col.load_weight("weight", w["col_w"])
    col.load_weight("bias", w["col_b"])
    torch.testing.assert_close(all_gather_last_dim(col(x)), x @ w["col_w"].T + w["col_b"], **TOL)

    # Merged gate|up: each rank holds [gate shard | up shard].
    merged = MergedColumnParallelLinear(HIDDEN, [64, 64])
    merged.load_weight("weight", w["gate"], 0)
    merged.load_weight("weight", w["up"], 1)
    gate, up = merged(x).chunk(2, dim=-1)
    torch.testing.assert_close(all_gather_last_dim(gate), x @ w["gate"].T, **TOL)
    torch.testing.assert_close(all_gather_last_dim(up), x @ w["up"].T, **TOL)

    # QKV with 2 KV heads (one per rank) and with 1 (replicated on both ranks).
    for kv_heads in (2, 1):
        layer = _qkv(w, kv_heads)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        torch.testing.assert_close(all_gather_last_dim(q), x @ w["q"].T + w["q_b"], **TOL)
        full_k = x @ (w["k2"] if kv_heads == 2 else w["k1"]).T
        full_v = x @ (w["v2"] if kv_heads == 2 else w["v1"]).T
        start = layer.kv_head_start * HEAD_DIM
        torch.testing.assert_close(k, full_k[:, start : start + layer.kv_size], **TOL)
        torch.testing.assert_close(v, full_v[:, start : start + layer.kv_size], **TOL)
        if kv_heads == 1:
            assert layer.kv_head_start == 0 and layer.num_kv_heads == 1

    # Row-parallel: each rank multiplies its input columns; the all-reduce sums them, the bias once.
    row = RowParallelLinear(48, HIDDEN, bias=True)
    row.load_weight("weight", w["row_w"])
    row.load_weight("bias", w["row_b"])
    start, end = row.in_start, row.in_start + row.weight.shape[1]
    torch.testing.assert_close(row(w["row_x"][:, start:end]), w["row_x"] @ w["row_w"].T + w["row_b"], **TOL)

    # Vocab-parallel embedding (37 rows, the last shard padded) and the LM head over it.
    embed = VocabParallelEmbedding(37, HIDDEN)
    embed.load_weight("weight", w["embed"])
    torch.testing.assert_close(embed(w["ids"]), w["embed"][w["ids"]], atol=0, rtol=0)  # sums with zeros: exact
    head = ParallelLMHead(37, HIDDEN)
    head.load_weight("weight", w["embed"])
    torch.testing.assert_close(head(x), x @ w["embed"].T, **TOL)
    tied = ParallelLMHead(37, HIDDEN)
    tied.tie_to(embed)
    torch.testing.assert_close(tied(x), head(x), atol=0, rtol=0)


def _worker(rank: int, size: int, port: int) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                                       timeout=datetime.timedelta(seconds=60))
    distributed.init_tensor_parallel(rank, size, store, torch.device("cpu"))
    try:
        assert distributed.get_tp_group() == TPGroup(rank, size)
        _check_rank(rank, size, _full_weights(0))
        assert distributed.min_over_ranks(10 + rank) == 10
        assert distributed.gather_from_ranks({"rank": rank}) == [{"rank": r} for r in range(size)]
    finally:
        distributed.destroy_tensor_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_layers_over_two_gloo_ranks_equal_the_full_layers() -> None:
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)


def test_one_rank_is_the_identity() -> None:
    """At one rank the same code runs without any process group."""
    _check_rank(0, 1, _full_weights(1))


def test_kv_heads_replicated_over_four_ranks() -> None:
    """2 KV heads over 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 head 1,
    and each rank's query heads are the ones that attend with that head."""
    w = _full_weights(2)
    q_heads = []
    for rank in range(4):
        with tp_group_as(TPGroup(rank, 4)):
            layer = _qkv(w, 2)
        assert layer.num_heads == 1 and layer.num_kv_heads == 1
        assert layer.kv_head_start == rank // 2
        q_heads.append(layer.q_head_start)
        # Query head h uses KV head h // (4 / 2) in the full model.
        assert layer.q_head_start // 2 == layer.kv_head_start
        k = layer.weight[layer.q_size : layer.q_size + layer.kv_size]
        torch.testing.assert_close(k, w["k2"][layer.kv_head_start * HEAD_DIM : (layer.kv_head_start + 1) * HEAD_DIM])
    assert q_heads == [0, 1, 2, 3]


def test_uneven_splits_are_refused() -> None:
    with tp_group_as(TPGroup(0, 3)), pytest.raises(ValueError, match="do not divide"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, 6, 2, bias=False)  # 3 ranks over 2 KV heads
    with tp_group_as(TPGroup(0, 2)), pytest.raises(ValueError, match="does not divide"):
        MergedColumnParallelLinear(HIDDEN, [63, 63])
    with tp_group_as(TPGroup(1, 2)):
        layer = ColumnParallelLinear(HIDDEN, 48)
    with pytest.raises(ValueError, match="checkpoint has 50 features"):
        layer.load_weight("weight", torch.zeros(50, HIDDEN))


def test_each_rank_reads_only_its_slices(tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 loads the qwen2 checkpoint (q/k/v bias, untied head)
    through partial reads only, and gets exactly its slices."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from aioserve.models import weight_loader
    from aioserve.models.model_config import ModelConfig

    path = tiny_checkpoints["qwen2"]
    read: list[tuple[str, tuple[int, ...]]] = []

    class Recording:
        """safe_open whose whole-tensor reads fail and partial reads are logged."""

        def __init__(self, *args, **kwargs) -> None:
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            raise AssertionError(f"{name} read whole")

        def get_slice(self, name):
            part = self.file.get_slice(name)

            class Slice:
                def get_shape(self):
                    return part.get_shape()

                def get_dtype(self):
                    return part.get_dtype()

                def __getitem__(self, index):
                    out = part[index]
                    read.append((name, tuple(out.shape)))
                    return out

            return Slice()

    monkeypatch.setattr(weight_loader, "safe_open", Recording)
    config = ModelConfig.from_path(path)
    with tp_group_as(TPGroup(1, 2)):
        model = weight_loader.build_model(config, path, torch.float32, torch.device("cpu"), "auto", 0)
    full = load_file(path / "model.safetensors")
    sizes = dict(read)
    assert sizes["model.layers.0.self_attn.q_proj.weight"] == (2 * config.head_dim, config.hidden_size)
    assert sizes["model.layers.0.mlp.down_proj.weight"] == (config.hidden_size, config.intermediate_size // 2)
    assert sizes["lm_head.weight"] == (config.vocab_size // 2, config.hidden_size)
    layer = model.model.layers[0]
    d = config.head_dim
    qkv = layer.self_attn.qkv_proj
    torch.testing.assert_close(qkv.weight[: 2 * d], full["model.layers.0.self_attn.q_proj.weight"][2 * d : 4 * d])
    torch.testing.assert_close(qkv.bias[2 * d : 3 * d], full["model.layers.0.self_attn.k_proj.bias"][d : 2 * d])
    half = config.intermediate_size // 2
    torch.testing.assert_close(layer.mlp.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"][:, half:])
    torch.testing.assert_close(
        layer.mlp.gate_up_proj.weight[half:], full["model.layers.0.mlp.up_proj.weight"][half:]
    )
    torch.testing.assert_close(model.model.norm.weight, full["model.norm.weight"])


@pytest.fixture(autouse=True)
def _no_leaked_group():
    yield
    assert distributed.get_tp_group() == TPGroup()
    assert not torch.distributed.is_initialized()
    assert os.environ.get("MASTER_ADDR") is None  # we never rely on env:// initialisation
