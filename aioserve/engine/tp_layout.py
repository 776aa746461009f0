"""What each tensor-parallel rank holds: its shard of heads, MLP columns and
vocabulary, its KV pool, where it runs. Gathered from every rank at start-up
for the log and /server_info, and used to check that the ranks agree on the
facts they must share (a multi-node run with another checkpoint on one node
fails here, not with garbage tokens)."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from aioserve.tp.distributed import TPGroup, gather_from_ranks
from aioserve.kvcache.kv_pool import KVPool
from aioserve.layers.embedding import VocabParallelEmbedding
from aioserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from aioserve.models.causal_lm import CausalLM
from aioserve.models.model_config import ModelConfig


class EngineView(Protocol):
    """What is read of the Engine (engine.py imports this module)."""

    tp: TPGroup
    model_config: ModelConfig
    device: torch.device
    pool: KVPool
    num_pages: int
    page_size: int
    max_model_len: int
    dtype: torch.dtype
    kv_dtype: torch.dtype

    @property
    def model(self) -> CausalLM: ...

    @property
    def kv_capacity_tokens(self) -> int: ...


@dataclass
class RankShard:
    rank: int
    host: str
    pid: int
    device: str
    threads: int | None  # torch intra-op threads (CPU)
    attention_heads: list[int]  # [start, end) of the query heads
    kv_heads: list[int]  # [start, end) of the KV heads
    kv_heads_replicated: bool  # fewer KV heads than ranks: this rank holds a copy
    mlp_columns: list[int]  # [start, end) of the intermediate features
    vocab_rows: list[int]  # [start, end) of the embedding / LM head rows
    kv_pages: int
    kv_tokens: int
    kv_bytes: int
    agreed: dict[str, Any]  # facts every rank must share


def _first(model: CausalLM, kind: type) -> Any:
    return next((m for m in model.modules() if isinstance(m, kind)), None)


def describe_rank(engine: EngineView) -> RankShard:
    config, tp = engine.model_config, engine.tp
    qkv = _first(engine.model, QKVParallelLinear)
    mlp = _first(engine.model, MergedColumnParallelLinear)
    embed = _first(engine.model, VocabParallelEmbedding)
    mlp_width = mlp.part_sizes[0] if mlp is not None else 0
    mlp_start = tp.rank * mlp_width
    return RankShard(
        rank=tp.rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=str(engine.device),
        threads=torch.get_num_threads() if engine.device.type == "cpu" else None,
        attention_heads=[qkv.q_head_start, qkv.q_head_start + qkv.num_heads],
        kv_heads=[qkv.kv_head_start, qkv.kv_head_start + qkv.num_kv_heads],
        kv_heads_replicated=config.num_kv_heads < tp.size,
        mlp_columns=[mlp_start, mlp_start + mlp_width],
        vocab_rows=[embed.vocab_start, embed.vocab_end],
        kv_pages=engine.num_pages,
        kv_tokens=engine.kv_capacity_tokens,
        kv_bytes=engine.pool.buffer.numel() * engine.pool.buffer.element_size(),
        agreed={
            "architecture": config.architecture,
            "num_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "max_model_len": engine.max_model_len,
            "page_size": engine.page_size,
            "kv_pages": engine.num_pages,
            "dtype": str(engine.dtype),
            "kv_dtype": str(engine.kv_dtype),
        },
    )


def gather_layout(engine: EngineView) -> list[dict[str, Any]]:
    """Every rank's RankShard as a dict, in rank order; ValueError when the
    ranks disagree on what they must share."""
    layout = gather_from_ranks(asdict(describe_rank(engine)))
    rank0 = layout[0]["agreed"]
    for shard in layout[1:]:
        if shard["agreed"] != rank0:
            differ = {k: (rank0.get(k), v) for k, v in shard["agreed"].items() if rank0.get(k) != v}
            raise ValueError(f"rank {shard['rank']} disagrees with rank 0 (rank 0, rank {shard['rank']}): {differ}")
    return layout


def _span(bounds: list[int]) -> str:
    start, end = bounds
    return f"{start}" if end - start == 1 else f"{start}-{end - 1}" if end > start else "none"


def layout_lines(layout: list[dict[str, Any]]) -> list[str]:
    """One readable line per rank, for the start-up log."""
    lines = []
    for s in layout:
        threads = f", {s['threads']} thread(s)" if s["threads"] else ""
        lines.append(
            f"rank {s['rank']} ({s['host']} pid {s['pid']}, {s['device']}{threads}): "
            f"attention heads {_span(s['attention_heads'])}, KV heads {_span(s['kv_heads'])}"
            f"{' (replicated)' if s['kv_heads_replicated'] else ''}, MLP columns {_span(s['mlp_columns'])}, "
            f"vocab rows {_span(s['vocab_rows'])}; KV pool {s['kv_pages']} pages = {s['kv_tokens']} tokens "
            f"({s['kv_bytes'] / 2**20:.1f} MiB)"
        )
    return lines
