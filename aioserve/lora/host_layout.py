"""A PEFT adapter laid out as this rank's slots hold it.

Each adapted module of the checkpoint (`q_proj`, `gate_proj`, ...) finds its
layer the way the weight loader finds a weight (models/weight_loader.py's
`checkpoint_target`), with its fused part. For each layer: A's rows go to
the part's band of rank rows (A whole for a column-parallel layer, its
input columns' shard for a row-parallel one), and B, scaled and transposed,
to the same band over the part's output rows of this rank (a
column-parallel layer's shard; whole for a row-parallel one). Bands the
adapter leaves out stay zero. A tensor that does not fit its layer means
an adapter of another base model: refused, naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aioserve.layers.linear import ColumnParallelLinear, QuantizableLinear, RowParallelLinear
from aioserve.lora.peft_folder import ModuleAdapter, PeftAdapter
from aioserve.lora_config import AdapterError
from aioserve.models.model_config import ModelConfig
from aioserve.models.weight_loader import checkpoint_target


@dataclass
class HostAdapter:
    """An adapter read and laid out for this rank: per adapted layer (by its
    qualified name in the model), A [P * R, in] and B [P * R, out]."""

    path: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers.values())

    def rounded_to(self, dtype: torch.dtype) -> HostAdapter:
        """The same adapter with every weight rounded to `dtype` (--lora-dtype), held in its own dtype."""
        return HostAdapter(self.path, {name: (a.to(dtype).to(a.dtype), b.to(dtype).to(b.dtype))
                                       for name, (a, b) in self.layers.items()})


def adaptable_layers(model: nn.Module) -> dict[str, QuantizableLinear]:
    """The linear layers adapters may adapt: every tensor-parallel projection
    of the decoder (attention's and the dense MLP's; an MoE block's experts
    are a stacked weight of their own, not among them)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantizableLinear)}


def part_ids(layer: QuantizableLinear) -> tuple[object, ...]:
    """The fused parts of a layer, each with its band of rank rows (q, k, v; gate, up; or the one)."""
    return tuple(getattr(layer, "shard_ids", (None,)))


def part_columns(layer: QuantizableLinear) -> tuple[int, ...]:
    """Where each fused part's output columns start on this rank, then the
    layer's width: (0, q, q + kv, out) for q|k|v; (0, out) for one part."""
    parts = part_ids(layer)
    if len(parts) == 1:
        return (0, layer.out_features)
    assert isinstance(layer, ColumnParallelLinear)  # only column-parallel layers fuse parts
    starts = [layer.part_rows(shard)[0] for shard in parts]
    return (*starts, layer.out_features)


def _place(
    layer: QuantizableLinear, module: ModuleAdapter, shard: object, band: int, a: torch.Tensor, b: torch.Tensor
) -> None:
    """Copy one module's A and scaled B into `layer`'s band for part `shard`."""
    first = part_ids(layer).index(shard) * band
    rank = module.rank
    lora_b = module.b.float() * module.scale
    if isinstance(layer, RowParallelLinear):
        if module.a.shape[1] != layer.in_full or module.b.shape[0] != layer.out_features:
            raise AdapterError(_mismatch(module, layer.in_full, layer.out_features))
        a[first : first + rank] = module.a[:, layer.in_start : layer.in_start + layer.in_features]
        b[first : first + rank] = lora_b.T
        return
    assert isinstance(layer, ColumnParallelLinear)  # every adaptable layer is one or the other
    offset, size, start, full = layer.part_rows(shard)
    if module.a.shape[1] != layer.in_features or module.b.shape[0] != full:
        raise AdapterError(_mismatch(module, layer.in_features, full))
    a[first : first + rank] = module.a
    b[first : first + rank, offset : offset + size] = lora_b[start : start + size].T


def _mismatch(module: ModuleAdapter, in_features: int, out_features: int) -> str:
    return (
        f"{module.name}: lora_A {tuple(module.a.shape)} and lora_B {tuple(module.b.shape)} do not fit the served "
        f"model's layer ({in_features} in, {out_features} out): an adapter of another base model?"
    )


def lay_out(
    adapter: PeftAdapter, model: nn.Module, config: ModelConfig, band: int, dtype: torch.dtype
) -> HostAdapter:
    """`adapter` as this rank's slots hold it; AdapterError for a module the
    model has not or does not adapt, or a tensor of the wrong size."""
    qualified = {id(module): name for name, module in adaptable_layers(model).items()}
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in adapter.modules:
        target = checkpoint_target(model, config, module.name + ".weight")
        if target is None:
            raise AdapterError(
                f"{module.name}: the served model has no such layer ({config.architecture}, "
                f"{config.num_layers} layers): an adapter of another base model?"
            )
        layer, _, shard = target
        name = qualified.get(id(layer))
        if name is None:
            raise AdapterError(
                f"{module.name}: adapters are served on the attention and dense MLP projections, not on "
                f"{type(layer).__name__} (MoE experts and routers, embeddings and the LM head are not adapted)"
            )
        assert isinstance(layer, QuantizableLinear)
        if name not in layers:
            rows = band * len(part_ids(layer))
            layers[name] = (torch.zeros(rows, layer.in_features), torch.zeros(rows, layer.out_features))
        _place(layer, module, shard, band, *layers[name])
    return HostAdapter(str(adapter.path), {name: (a.to(dtype), b.to(dtype)) for name, (a, b) in layers.items()})
