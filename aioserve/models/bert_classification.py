"""Sequence classifiers over the encoders (cross-encoder rerankers): the
encoder under `model`, and a `score_head` that reads one row of each
sequence, its first (`[CLS]`, `<s>`), as Hugging Face's heads do:

* BERT: the pooler (dense + tanh) then `classifier`;
* XLM-R: `classifier.dense` + tanh then `classifier.out_proj`.

The heads are small and held whole on every rank (ReplicatedLinear). The
scores come out float32, like a decoder's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.layers.embedding import VocabParallelEmbedding
from aioserve.layers.linear import ReplicatedLinear
from aioserve.models.bert import BertModel, XLMRobertaModel, encoder_of
from aioserve.models.encoder_lm import EncoderLM
from aioserve.models.model_config import ModelConfig


class BertPoolerHead(nn.Module):
    """tanh(pooler(row)) -> classifier: Hugging Face's BertPooler and the
    classifier of BertForSequenceClassification (its dropout is off at inference)."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.pooler = ReplicatedLinear(hidden, hidden)
        self.classifier = ReplicatedLinear(hidden, num_labels)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(rows))).float()


class RobertaClassificationHead(nn.Module):
    """out_proj(tanh(dense(row))): Hugging Face's XLMRobertaClassificationHead."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(hidden, hidden)
        self.out_proj = ReplicatedLinear(hidden, num_labels)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(rows))).float()


class EncoderForSequenceClassification(EncoderLM):
    """The encoder (`model`) and a scoring head. The forward is the
    encoder's: [T, hidden]; the caller picks each sequence's `score_row`
    and passes those rows to `score_head`: [N, hidden] -> [N, num_labels]."""

    score_row = "first"  # which row of a sequence the head reads
    encoder_cls: type[BertModel] = BertModel
    # Checkpoint name prefix -> ours (or None: not used), tried in order before the encoder's own names.
    head_names: tuple[tuple[str, str | None], ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.num_labels = encoder_of(config).num_labels
        self.model = self.encoder_cls(config)
        self.score_head = self.build_head(config.hidden_size, self.num_labels)

    def build_head(self, hidden: int, num_labels: int) -> nn.Module:
        raise NotImplementedError

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> Sequence[nn.Module]:
        return self.model.decoder_layers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token: [T, hidden] (score_head reads each sequence's first)."""
        return self.model(input_ids, positions, meta)

    def checkpoint_name(self, name: str) -> str | None:
        for theirs, ours in self.head_names:
            if name.startswith(theirs):
                return None if ours is None else ours + name.removeprefix(theirs)
        prefix = self.model.checkpoint_prefix
        if not name.startswith(prefix):
            return name  # not the encoder's: the loader reports it as unknown
        inner = self.model.checkpoint_name(name)
        return None if inner is None else "model." + inner


class BertForSequenceClassification(EncoderForSequenceClassification):
    encoder_cls = BertModel
    head_names = (("bert.pooler.dense.", "score_head.pooler."), ("classifier.", "score_head.classifier."))

    def build_head(self, hidden: int, num_labels: int) -> nn.Module:
        return BertPoolerHead(hidden, num_labels)


class XLMRobertaForSequenceClassification(EncoderForSequenceClassification):
    encoder_cls = XLMRobertaModel
    # (Its encoder has no pooler: Hugging Face builds it without one; older checkpoints may hold one.)
    head_names = (("roberta.pooler.", None), ("classifier.", "score_head."))

    def build_head(self, hidden: int, num_labels: int) -> nn.Module:
        return RobertaClassificationHead(hidden, num_labels)
