"""FP8 e4m3 weights, the quantisation aioserve runs. `Fp8Config`, read here
from a quantization_config of quant_method "fp8" (or from compressed-tensors,
compressed_tensors.py), is the QuantMethod the weight loader asks for such a
checkpoint. Its answers come from:

  fp8_checkpoint.py   the tensors beside a weight (its scale), a weight dequantised as it is read
  fp8_layers.py       which linear layers hold e4m3 and multiply in FP8; the block-scaled self-check
  fp8_loading.py      the e4m3 values and their scales into such a layer; dummy weights in its form
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aioserve.layers.linear import QuantizableLinear
from aioserve.quant.fp8_checkpoint import FP8_DTYPE, SIDE_SUFFIXES, Fp8CheckpointTensor, scale_name
from aioserve.quant.fp8_layers import self_check_block_fp8, use_fp8_matmuls
from aioserve.quant.fp8_loading import fill_dummy_fp8, load_fp8_weight
from aioserve.quant.method import LazyTensor, Owners, QuantMethod, UnsupportedQuantization

STORED_DTYPE = "F8_E4M3"  # the safetensors dtype of an e4m3 weight


@dataclass(frozen=True)
class Fp8Config(QuantMethod):
    """FP8 e4m3 weights. `strategy`: one scale per tensor ("tensor"), per
    output row ("channel": [N, 1] scales) or per `block` of (rows, cols)
    ("block"; `block` is None otherwise)."""

    block: tuple[int, int] | None
    activation_scheme: str  # "dynamic" or "static" (input_scale tensors, not used: activations are quantised per token)
    strategy: str = "tensor"
    method: str = "fp8"  # the quant_method it was written as: "fp8" or "compressed-tensors"

    @classmethod
    def from_fp8(cls, raw: dict[str, Any]) -> "Fp8Config":
        """quant_method "fp8": e4m3 weights with a scale per tensor, or per
        `weight_block_size` block; raises for another FP8 format."""
        fmt = str(raw.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise UnsupportedQuantization(f"FP8 in the {fmt!r} format: aioserve loads e4m3 weights only")
        block = raw.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise UnsupportedQuantization(f"FP8 weight_block_size {block!r}: expected [rows, cols]")
        return cls(tuple(block) if block else None, str(raw.get("activation_scheme", "dynamic")),
                   "block" if block else "tensor")

    def reads_with_weight(self, name: str) -> bool:
        return name.endswith(SIDE_SUFFIXES)

    def stores_quantised(self, safetensors_dtype: str) -> bool:
        return safetensors_dtype == STORED_DTYPE

    def prepare(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype, mode: str, stored: set[int] | None
    ) -> None:
        use_fp8_matmuls(model, self.block, device, dtype, mode, stored)

    def load_held(self, layer: QuantizableLinear, tensor: LazyTensor, owner: Owners, shard: object) -> torch.dtype:
        return load_fp8_weight(layer, tensor, owner, shard)

    def as_wide(self, tensor: LazyTensor, owner: Owners) -> LazyTensor:
        if tensor.dtype != FP8_DTYPE:
            return tensor
        name = scale_name(tensor.name, owner)
        return Fp8CheckpointTensor(tensor, owner[name].get_tensor(name), self.strategy, self.block)

    def fill_dummy(self, layer: QuantizableLinear, wide: torch.Tensor) -> None:
        fill_dummy_fp8(layer, wide)

    def after_loading(self, model: nn.Module, dtype: torch.dtype) -> None:
        self_check_block_fp8(model, dtype)
