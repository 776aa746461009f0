"""BERT and XLM-R encoders: word + absolute position + token-type
embeddings under a LayerNorm, then post-LN layers (self-attention with
biased q/k/v/o, then a GELU MLP, each followed by the residual add and a
LayerNorm). The output is every token's final hidden state, Hugging Face's
`last_hidden_state`; bert_classification.py puts the scoring heads on it.

Module names mirror Hugging Face's (`embeddings.word_embeddings`,
`encoder.layer.<i>.attention.output.dense`, ...) except that q/k/v are fused
into one matmul, as in the decoders, and sharded over tensor-parallel ranks
the same way (the MLP's up projection by columns, the down one by rows).

The engine passes 0-based positions and no token types, so the model
derives both: XLM-R's position ids start after its padding id (the offset
is added here), and a BERT pair `[CLS] A [SEP] B [SEP]` gives type 1 to
every token after the first [SEP] of its sequence, as BERT's tokenizer does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.layers.activation import activation
from aioserve.layers.embedding import ReplicatedEmbedding, VocabParallelEmbedding
from aioserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aioserve.layers.norm import LayerNorm
from aioserve.models.encoder_config import EncoderConfig
from aioserve.models.encoder_lm import EncoderLM
from aioserve.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Hugging Face's names inside a layer -> ours (q/k/v fused: the weight
# loader maps q_proj/k_proj/v_proj to qkv_proj's parts).
_LAYER_RENAMES = {
    ".attention.self.query.": ".attention.q_proj.",
    ".attention.self.key.": ".attention.k_proj.",
    ".attention.self.value.": ".attention.v_proj.",
}
# The oldest BERT checkpoints (TensorFlow conversions) name LayerNorm's parameters so.
_OLD_NORM_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def encoder_of(config: ModelConfig) -> EncoderConfig:
    if config.encoder is None:
        raise ValueError(f"{config.architecture}: model_type {config.model_type!r} is not an encoder's")
    return config.encoder


def pair_token_types(input_ids: torch.Tensor, positions: torch.Tensor, sep_id: int) -> torch.Tensor:
    """[T] token types of a step of whole sequences laid side by side (each
    starting where its position is 0): 1 for a token after a [SEP] of its
    own sequence, else 0. `[CLS] A [SEP] B [SEP]` -> 0 for CLS, A and the
    first SEP; 1 for B and the last SEP, as BERT's tokenizer types a pair."""
    is_sep = (input_ids == sep_id).long()
    seps_before = torch.cumsum(is_sep, 0) - is_sep  # over the whole step, this token excluded
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    starts = torch.where(positions == 0, rows, torch.zeros_like(rows))
    first = torch.cummax(starts, 0).values  # the row its sequence starts at
    return (seps_before - seps_before[first] > 0).long()


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        enc = encoder_of(config)
        self.position_offset = enc.position_offset
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # ModelConfig counts the positions the engine may use; the table has the offset's rows too.
        self.position_embeddings = ReplicatedEmbedding(
            config.max_position_embeddings + enc.position_offset, config.hidden_size
        )
        self.token_type_embeddings = ReplicatedEmbedding(enc.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, enc.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        # Hugging Face's order of the sums (word + type, then + position): the same rounding.
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(hidden)


class BertOutput(nn.Module):
    """dense, then LayerNorm(dense + the block's input): HF's BertSelfOutput and BertOutput."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, hidden, bias=True)
        self.LayerNorm = LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, bias=True
        )
        self.output = BertOutput(config.num_heads * config.head_dim, config.hidden_size, encoder_of(config).layer_norm_eps)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        proj = self.qkv_proj
        q, k, v = proj(hidden).split([proj.q_size, proj.kv_size, proj.kv_size], dim=-1)
        tokens = hidden.shape[0]
        q = q.reshape(tokens, proj.num_heads, self.head_dim)
        k = k.reshape(tokens, proj.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, proj.num_kv_heads, self.head_dim)
        out = meta.attend(self.layer_id, q, k, v, self.scale, None)  # not causal: the backend's plan says so
        return self.output(out.reshape(tokens, -1), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.attention = BertAttention(config, layer_id)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config.hidden_size, encoder_of(config).layer_norm_eps)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_layers))


class BertModel(EncoderLM):
    """The encoder alone, for embeddings: Hugging Face's BertModel without
    its pooler (an embedding pools the hidden states itself)."""

    checkpoint_prefix = "bert."  # before every tensor in a task model's checkpoint (BertForMaskedLM, ...)
    # A task model's tensors outside the encoder, which an embedding has no use for.
    unused_prefixes = ("pooler.", "cls.", "lm_head.", "classifier.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        enc = encoder_of(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.sep_token_id = enc.sep_token_id if enc.derives_token_types else None
        if enc.pair_token_types and enc.type_vocab_size > 1 and enc.sep_token_id is None:
            logger.warning("%s: no [SEP] id known: every token gets type 0 (a text pair is typed wrong)",
                           config.architecture)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.embeddings.word_embeddings

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The encoder's layers: layer i reads and writes the KV pool's layer i, as a decoder's."""
        return list(self.encoder.layer)

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        return pair_token_types(input_ids, positions, self.sep_token_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token: [T, hidden]."""
        hidden = self.embeddings(input_ids, positions, self.token_types(input_ids, positions))
        for layer in cast("list[BertLayer]", list(self.encoder.layer)):
            hidden = layer(hidden, meta)
        return hidden

    def checkpoint_name(self, name: str) -> str | None:
        """Ours for a checkpoint name, with or without the task model's prefix
        (sentence-transformers folders save the encoder without it)."""
        name = name.removeprefix(self.checkpoint_prefix)
        if name.startswith(self.unused_prefixes) or name.endswith(".position_ids"):
            return None  # (position_ids: a buffer some older checkpoints saved)
        for theirs, ours in (*_LAYER_RENAMES.items(), *_OLD_NORM_NAMES.items()):
            name = name.replace(theirs, ours)
        return name


class XLMRobertaModel(BertModel):
    """BERT's network under another prefix; positions offset past the
    padding id and one token type (config.json: model_type xlm-roberta)."""

    checkpoint_prefix = "roberta."
