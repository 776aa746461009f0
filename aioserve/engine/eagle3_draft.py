"""Loading speculative decoding's EAGLE-3 head (the eagle3 method).

The head is checked against the target before its weights load: its `fc`
reads three of the target's hidden states, so their width must be the
target's; its `d2t` maps into the target's vocabulary, so that must be the
vocabulary it was trained for; and it reads three of the target's layers,
which must exist. The head's state rides the target's pages: its one-layer
KV pool, and per KV slot the head's last output there (the token it
proposes next, its pre-norm hidden state), which the next step's first
draft starts from (engine/eagle3_runner.py). loading.pool_pages counts a
page of all three into the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from aioserve.config import ConfigError, EngineConfig
from aioserve.kvcache.kv_pool import KVPool
from aioserve.models.eagle3 import Eagle3Config, Eagle3Head
from aioserve.models.model_config import ModelConfig
from aioserve.models.source import resolve_model_path
from aioserve.models.weight_loader import build_module, safetensors_files

logger = logging.getLogger(__name__)


@dataclass
class LoadedEagle3:
    model_path: Path
    config: Eagle3Config
    head: Eagle3Head
    aux_layers: tuple[int, ...]  # the target layers whose input the head reads (DecoderModel.aux_layers)


def aux_layers(config: Eagle3Config, target: ModelConfig, path: Path) -> tuple[int, ...]:
    """Which layers' input (the residual stream entering them) the target
    hands the head. The published default is layers 2, L/2 and L-3 (vLLM's
    and SGLang's alike); a config's eagle_aux_hidden_state_layer_ids name
    layer *outputs*, i.e. the input of the layer after each."""
    layers = target.num_layers
    if config.aux_layer_ids is not None:
        chosen = tuple(i + 1 for i in config.aux_layer_ids)
    else:
        chosen = (2, layers // 2, layers - 3)
    if not all(0 <= i < layers for i in chosen):
        raise ConfigError(
            f"the EAGLE-3 head {path} reads the target's layers at inputs {list(chosen)}, but the target has "
            f"{layers} layers" + ("" if config.aux_layer_ids is not None else
                                  " (set eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
        )
    return chosen


def check_eagle3(config: Eagle3Config, target: ModelConfig, path: Path) -> None:
    if target.is_encoder or target.vision is not None:
        raise ConfigError(
            "speculative decoding with an EAGLE-3 head serves text-only decoder targets in this version of aioserve "
            f"(the target is {target.architecture})"
        )
    if config.target_hidden_size != target.hidden_size:
        raise ConfigError(
            f"the EAGLE-3 head {path} reads hidden states of width {config.target_hidden_size}, the target's are "
            f"{target.hidden_size}: a head is trained for one target"
        )
    if config.layer.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the EAGLE-3 head {path} maps into a vocabulary of {config.layer.vocab_size} tokens and the target has "
            f"{target.vocab_size}: a head is trained for one target"
        )
    if config.layer.hidden_size != target.hidden_size:
        # The head embeds tokens with the target's table (it has none of its own).
        raise ConfigError(
            f"the EAGLE-3 head {path} is {config.layer.hidden_size} wide and the target's embeddings "
            f"{target.hidden_size}: the head reads the target's embedding table"
        )


def _has_tensor(path: Path, names: tuple[str, ...]) -> bool:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            if any(name in handle.keys() for name in names):
                return True
    return False


def load_eagle3(
    config: EngineConfig, head_path: str, target: ModelConfig, dtype: torch.dtype, weight_dtype: torch.dtype,
    device: torch.device,
) -> LoadedEagle3:
    path = resolve_model_path(head_path, None)
    try:
        eagle = Eagle3Config.from_path(path)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise ConfigError(f"speculative decoding's EAGLE-3 head: {exc}") from exc
    check_eagle3(eagle, target, path)
    layers = aux_layers(eagle, target, path)
    if eagle.draft_vocab_size != target.vocab_size and not _has_tensor(path, ("d2t", "model.d2t")):
        raise ConfigError(
            f"the EAGLE-3 head {path} proposes from {eagle.draft_vocab_size} tokens of the target's "
            f"{target.vocab_size} but holds no d2t map to name them"
        )
    try:
        head = build_module(lambda: Eagle3Head(eagle), eagle.layer, path, dtype, device, round_to=weight_dtype)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"speculative decoding's EAGLE-3 head: {exc}") from exc
    assert isinstance(head, Eagle3Head)
    logger.info("EAGLE-3 head: %s (draft vocabulary %d, reads the target's layers %s)",
                path, eagle.draft_vocab_size, list(layers))
    return LoadedEagle3(path, eagle, head, layers)


def eagle3_bytes_per_page(
    config: Eagle3Config, page_size: int, kv_dtype: torch.dtype, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """One page of the head's KV pool on a rank (its share of the KV heads)
    and of its per-slot state (a token id, a whole hidden state: every rank
    holds it)."""
    layer = config.layer
    kv = KVPool.bytes_per_page(1, page_size, layer.kv_heads_per_rank(tp_size), layer.head_dim, kv_dtype)
    per_slot = 8 + layer.hidden_size * dtype.itemsize
    return kv + page_size * per_slot

