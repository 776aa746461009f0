"""Token embedding and LM head with the vocabulary split over ranks; a
replicated embedding for small tables (an encoder's positions and token types)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aioserve.tp.distributed import all_gather_last_dim, all_reduce, get_tp_group
from aioserve.cpu.matmul import MatmulChoice, is_packed, packed_rows
from aioserve.layers.linear import linear


# The most logits (float32 values) the LM head keeps a buffer for: 256 rows of
# a 150k vocabulary, 156 MB.
MAX_BUFFERED_LOGITS = 256 * 152_064


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous block of vocabulary rows; ids outside the
    block embed to zero locally, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp_group()
        per_rank = -(-vocab_size // tp.size)  # ceil: the last shard is padded
        self.vocab_size = vocab_size
        # With a tiny vocabulary over many ranks the last ones may hold no row.
        self.vocab_start = min(vocab_size, tp.rank * per_rank)
        self.vocab_end = min(vocab_size, self.vocab_start + per_rank)
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden), requires_grad=False)
        self.dtype = self.weight.dtype  # of the embeddings, whatever a tied LM head packs the weight in

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        rows = self.vocab_end - self.vocab_start
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != self.weight.shape[1]:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} does not match the config")
        self.weight.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if is_packed(self.weight):  # tied to an LM head packed for the native matmul
            return packed_rows(self.weight, ids).to(self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_group().size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (ids >= self.vocab_end)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ReplicatedEmbedding(nn.Module):
    """A table every rank holds whole: BERT's position and token-type
    embeddings (512 and 2 rows), where splitting them would cost an
    all-reduce each step for nothing."""

    def __init__(self, num_embeddings: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_embeddings, hidden), requires_grad=False)

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        if tuple(loaded.shape) != tuple(self.weight.shape):
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} != {tuple(self.weight.shape)}")
        self.weight.data.copy_(loaded[:])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; may share its weight with the
    embedding (tied checkpoints have no lm_head tensor)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)
        self.matmul_choice: MatmulChoice | None = None  # set by tune_cpu_matmuls or pack_cpu_weights
        self._logits_buffer = torch.empty(0, device="cpu")

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (the weights' rounding kept) where the packed CPU
        kernel writes them directly; hidden's dtype elsewhere. The packed
        kernel's logits live in a buffer that the next call overwrites: they
        are used up within the step that asked for them."""
        out = self._packed_output(hidden)
        logits = all_gather_last_dim(linear(hidden, self.weight, choice=self.matmul_choice, float_out=True, out=out))
        return logits[..., : self.vocab_size]

    def _packed_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """A grow-only buffer for the packed kernel's logits. Over 32 MiB a
        fresh tensor is a fresh mapping every step, and touching it first
        faulted in every page: Qwen3's [64, 151936] float32 logits took
        11 ms that way against 1 ms to write into memory already mapped, in a
        decode step of ~250 ms. Calls bigger than MAX_BUFFERED_LOGITS (prompt
        logprobs over a long prompt) get a tensor of their own, not kept."""
        choice = self.matmul_choice
        if hidden.device.type != "cpu" or hidden.dim() != 2 or choice is None or choice.packed_features is None:
            return None
        size = hidden.shape[0] * choice.packed_features
        if size > MAX_BUFFERED_LOGITS:
            return None
        if self._logits_buffer.numel() < size:
            self._logits_buffer = torch.empty(size, dtype=torch.float32)
        return self._logits_buffer[:size].view(hidden.shape[0], choice.packed_features)
