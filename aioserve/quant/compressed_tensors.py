"""llm-compressor's "compressed-tensors" quantization_config: its FP8 schemes
(FP8, FP8_DYNAMIC, FP8_BLOCK: e4m3 weights with per-tensor, per-channel or
block scales) read as an Fp8Config (fp8.py), and a refusal naming what is
unsupported for every other scheme (int4/int8 or NVFP4 weights, sparsity,
transforms, mixed strategies, ...), before a weight is read."""

from __future__ import annotations

from typing import Any

from aioserve.quant.fp8 import Fp8Config
from aioserve.quant.method import UnsupportedQuantization

STRATEGIES = ("tensor", "channel", "block")
# compressed-tensors formats that store FP8 weights as e4m3 tensors beside their scales.
_CT_FP8_FORMATS = ("float-quantized", "naive-quantized")


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"compressed-tensors checkpoint with {what}: aioserve loads compressed-tensors checkpoints only with "
        "FP8 e4m3 weights (type float, num_bits 8, symmetric, strategy tensor, channel or block; "
        "format float-quantized or naive-quantized)"
    )


def from_compressed_tensors(raw: dict[str, Any]) -> Fp8Config:
    """llm-compressor's FP8 schemes (FP8, FP8_DYNAMIC, FP8_BLOCK): every config
    group FP8 weights of one strategy. Anything else is refused here, before
    a weight is read, naming what is unsupported."""
    sparsity = raw.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse(f"sparsity ({sparsity.get('format')!r} sparsity_config)")
    if raw.get("transform_config"):
        raise _refuse("transforms (transform_config: rotations applied to the weights)")
    groups = raw.get("config_groups") or {}
    if not groups:
        raise _refuse("no config_groups")
    schemes = {name: _group_scheme(name, group, str(raw.get("format") or "dense")) for name, group in groups.items()}
    weights = {(strategy, block) for strategy, block, _ in schemes.values()}
    if len(weights) > 1:
        listed = ", ".join(f"{name}: {s}" + (f" {list(b)}" if b else "") for name, (s, b, _) in schemes.items())
        raise _refuse(f"config groups of different FP8 weight strategies ({listed}); aioserve takes one for every group")
    (strategy, block), = weights
    activations = "static" if any(a == "static" for _, _, a in schemes.values()) else "dynamic"
    return Fp8Config(block, activations, strategy, "compressed-tensors")


def _group_scheme(name: str, group: dict[str, Any], top_format: str) -> tuple[str, tuple[int, int] | None, str]:
    """(weight strategy, block, activation scheme) of one config group, or a refusal naming what it is."""
    fmt = str(group.get("format") or top_format)
    if fmt == "mixed-precision":
        fmt = "mixed-precision without a format for the group"
    weights = group.get("weights")
    if not weights:
        raise _refuse(f"group {name!r} quantising no weights (activations only)")
    kind, bits = str(weights.get("type", "int")), int(weights.get("num_bits", 8))
    if (kind, bits) != ("float", 8):
        raise _refuse(f"{kind}{bits} weights in group {name!r} (format {fmt!r})")
    if fmt not in _CT_FP8_FORMATS:
        raise _refuse(f"format {fmt!r} in group {name!r}")
    if weights.get("dynamic"):
        raise _refuse(f"dynamic weight quantisation in group {name!r}")
    if not weights.get("symmetric", True):
        raise _refuse(f"asymmetric weights (zero points) in group {name!r}")
    strategy = str(weights.get("strategy") or "tensor").lower()
    if strategy not in STRATEGIES:
        raise _refuse(f"FP8 weights of strategy {strategy!r} in group {name!r}")
    block = weights.get("block_structure")
    if strategy == "block":
        if isinstance(block, str):  # the older "128x128" spelling
            block = [int(v) for v in block.split("x")]
        if not block or len(block) != 2 or min(block) < 1:
            raise _refuse(f"block strategy with block_structure {block!r} in group {name!r}")
    for side in ("input_activations", "output_activations"):
        args = group.get(side)
        if args and (str(args.get("type", "int")), int(args.get("num_bits", 8))) != ("float", 8):
            raise _refuse(f"{args.get('type')}{args.get('num_bits')} {side.replace('_', ' ')} in group {name!r}")
    if group.get("output_activations"):
        raise _refuse(f"quantised output activations in group {name!r}")
    inputs = group.get("input_activations")
    activations = "static" if inputs and not inputs.get("dynamic", False) else "dynamic"
    return strategy, tuple(block) if strategy == "block" else None, activations
