"""The `quantization_config` of a config.json: what aioserve can run (FP8
e4m3 weights with per-tensor, per-channel or block scales, written as
quant_method "fp8" or as llm-compressor's "compressed-tensors") and a clear
refusal, naming the format, for what it cannot (AWQ, GPTQ, bitsandbytes,
int4/int8 or NVFP4 compressed-tensors schemes, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The checkpoint tensors FP8 quantisation adds beside a weight: its scale
# (per tensor, per channel or per block; Qwen3-FP8 and DeepSeek name the
# block form `weight_scale_inv`, though it multiplies) and static activation scales.
WEIGHT_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
ACTIVATION_SCALE_SUFFIX = "input_scale"
# A compressed-tensors kv_cache_scheme's static KV scales (on the attention
# module, or as k_proj / v_proj `output_scale` in older checkpoints): the KV
# cache here is not quantised with them.
KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "output_scale")
STRATEGIES = ("tensor", "channel", "block")
# compressed-tensors formats that store FP8 weights as e4m3 tensors beside their scales.
_CT_FP8_FORMATS = ("float-quantized", "naive-quantized")


class UnsupportedQuantization(ValueError):
    """A checkpoint quantised in a format aioserve cannot load."""


@dataclass(frozen=True)
class Fp8Config:
    """FP8 e4m3 weights. `strategy`: one scale per tensor ("tensor"), per
    output row ("channel": [N, 1] scales) or per `block` of (rows, cols)
    ("block"; `block` is None otherwise)."""

    block: tuple[int, int] | None
    activation_scheme: str  # "dynamic" or "static" (input_scale tensors, not used: activations are quantised per token)
    strategy: str = "tensor"
    method: str = "fp8"  # the quant_method it was written as: "fp8" or "compressed-tensors"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "Fp8Config | None":
        """None for an unquantised checkpoint; raises for a format other than FP8 e4m3."""
        if not raw:
            return None
        method = str(raw.get("quant_method") or raw.get("quantization_method") or "unknown").lower()
        if method == "compressed-tensors":
            return _from_compressed_tensors(raw)
        if method != "fp8":
            raise UnsupportedQuantization(
                f"the checkpoint is quantised as {method!r} (config.json quantization_config), which aioserve "
                "cannot load; it runs unquantised checkpoints and FP8 e4m3 weights (quant_method 'fp8', or "
                "'compressed-tensors' with FP8 weights)"
            )
        fmt = str(raw.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise UnsupportedQuantization(f"FP8 in the {fmt!r} format: aioserve loads e4m3 weights only")
        block = raw.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise UnsupportedQuantization(f"FP8 weight_block_size {block!r}: expected [rows, cols]")
        return cls(tuple(block) if block else None, str(raw.get("activation_scheme", "dynamic")),
                   "block" if block else "tensor")


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"compressed-tensors checkpoint with {what}: aioserve loads compressed-tensors checkpoints only with "
        "FP8 e4m3 weights (type float, num_bits 8, symmetric, strategy tensor, channel or block; "
        "format float-quantized or naive-quantized)"
    )


def _from_compressed_tensors(raw: dict[str, Any]) -> Fp8Config:
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
