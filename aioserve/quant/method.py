"""The seam between a checkpoint's quantisation and the weight loader:
`QuantMethod`, what models/weight_loader.py asks of a quantised checkpoint.

A method is chosen once, from config.json's quantization_config
(config.py), and kept as ModelConfig.quantization. The loader asks it
before loading (which linear layers hold their weights quantised), for
each checkpoint tensor (one read with its weight, one stored quantised, a
weight of a layer it holds quantised) and after loading (its self-check).
A layer it holds quantised gets a LinearQuant (layers/linear.py) that its
forward asks for the product. A new format is one module here implementing
both, and one entry in config.py's table: the loader, the layers and the
model files stay as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
from torch import nn

from aioserve.layers.linear import QuantizableLinear

# Each checkpoint tensor's name -> the safetensors handle of the shard that
# holds it (a weight's scale may sit in another shard than the weight).
Owners = dict[str, Any]


class UnsupportedQuantization(ValueError):
    """A checkpoint quantised in a format aioserve cannot load."""


class LazyTensor(Protocol):
    """The loader's CheckpointTensor: a name, a shape, a dtype, and slicing."""

    name: str
    shape: torch.Size
    dtype: torch.dtype

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class QuantMethod(ABC):
    """A quantised checkpoint's format, as the weight loader sees it."""

    @abstractmethod
    def reads_with_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is read with its weight (a scale) or
        not used (static activation or KV scales), never loaded on its own."""

    @abstractmethod
    def stores_quantised(self, safetensors_dtype: str) -> bool:
        """Whether a weight of this safetensors dtype ("F8_E4M3", ...) is stored quantised."""

    @abstractmethod
    def prepare(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype, mode: str, stored: set[int] | None
    ) -> None:
        """Before loading: hold quantised the linear layers whose products
        can run so here (mode "auto"), or wherever the format allows
        ("force"), none with "off"; `stored`: the ids of the layers whose
        checkpoint weights are stored quantised (None: not from a file)."""

    @abstractmethod
    def load_held(self, layer: QuantizableLinear, tensor: LazyTensor, owner: Owners, shard: object) -> torch.dtype:
        """A checkpoint weight into a layer held quantised (its scales too);
        returns the dtype its values count as."""

    @abstractmethod
    def as_wide(self, tensor: LazyTensor, owner: Owners) -> LazyTensor:
        """A checkpoint tensor for a wide parameter: as stored, or, stored
        quantised, dequantised as it is read."""

    @abstractmethod
    def fill_dummy(self, layer: QuantizableLinear, wide: torch.Tensor) -> None:
        """Random weights for a layer held quantised: `wide` in its form."""

    @abstractmethod
    def after_loading(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Once the weights are in, before the first request: check the held
        layers' products, and widen (to `dtype`) any that fail."""
