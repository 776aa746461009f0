"""A batch plan as one flat byte tensor, and back: what rank 0 broadcasts.

The encoder walks the plan's dataclass fields (recursively: SamplingTensors,
PromptLogprobRequest and whatever dataclass a later field holds), so a field
added to the plan travels without touching this file. Supported values:
CPU tensors, None, bool, int, float, str, lists/tuples of these and nested
dataclasses of the `aioserve` package; anything else is refused by name.

Layout: [8-byte length of the description][description: JSON][tensor bytes,
each at a 16-byte aligned offset]. The description holds the structure,
scalars and each tensor's dtype, shape and offset; decoding makes the
tensors zero-copy views of the received buffer. JSON, not pickle: decoding
a buffer never runs code.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from typing import Any, cast

import numpy as np
import torch

ALIGN = 16
_HEADER = 8
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)}  # fmt: skip


# Tensors are packed and unpacked through numpy where it has the dtype: a
# few microseconds per tensor instead of tens for the equivalent torch ops,
# which matters at ~25 small tensors per decode step.
_NUMPY = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
          torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
          torch.float64: np.float64}  # fmt: skip
_PADDING = bytes(16)
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[bytes] = []  # each padded to ALIGN, in order
        self.size = 0

    def value(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value)
            if not cls.__module__.startswith("aioserve."):
                raise TypeError(f"{path}: only aioserve dataclasses travel, not {cls.__module__}.{cls.__qualname__}")
            return {
                "dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {
                    f.name: self.value(getattr(value, f.name), f"{path}.{f.name}") for f in dataclasses.fields(value)
                },
            }
        if isinstance(value, (list, tuple)):
            items = [self.value(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return {"tuple" if isinstance(value, tuple) else "list": items}
        raise TypeError(f"{path}: cannot broadcast a {type(value).__name__}")

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        if t.device.type != "cpu":
            # Plans are built on the host; reading a device tensor here would sync.
            raise ValueError(f"{path}: plan tensors must be on the CPU, not {t.device}")
        name = _NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"{path}: cannot broadcast a {t.dtype} tensor")
        # tobytes() writes C order whatever the strides.
        if t.dtype in _NUMPY:
            raw = t.numpy().tobytes()
        else:  # bfloat16: numpy has no such type, move its bytes as they are
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        offset = self.size
        self.tensors.append(raw + _PADDING[: _aligned(len(raw)) - len(raw)])
        self.size = _aligned(offset + len(raw))
        return {"tensor": name, "shape": list(t.shape), "offset": offset}


def encode(obj: Any) -> torch.Tensor:
    """`obj` (a dataclass, usually a BatchPlan) as one uint8 CPU tensor."""
    encoder = _Encoder()
    description = json.dumps(encoder.value(obj, type(obj).__name__), separators=(",", ":")).encode()
    pad = _aligned(_HEADER + len(description)) - _HEADER - len(description)
    head = len(description).to_bytes(_HEADER, "little") + description + _PADDING[:pad]
    return torch.frombuffer(bytearray(b"".join([head, *encoder.tensors])), dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def _dataclass_type(name: str) -> tuple[type, frozenset[str]]:
    """The class a description names, and its init fields."""
    module, _, qualname = name.partition(":")
    if not module.startswith("aioserve."):
        raise ValueError(f"refusing to build {name}: not an aioserve dataclass")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{name} is not a dataclass")
    return cast(type, cls), frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def decode(buffer: torch.Tensor) -> Any:
    """The object `encode` turned into `buffer`; its tensors are views of it."""
    raw = buffer.numpy()
    length = int.from_bytes(raw[:_HEADER].tobytes(), "little")
    description = json.loads(raw[_HEADER : _HEADER + length].tobytes())
    start = _aligned(_HEADER + length)

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "tensor" in node:
            dtype = _DTYPES[node["tensor"]]
            count = 1
            for dim in node["shape"]:
                count *= dim
            first = start + node["offset"]
            part = raw[first : first + count * dtype.itemsize]
            if dtype in _NUMPY:
                return torch.from_numpy(part.view(_NUMPY[dtype]).reshape(node["shape"]))
            return buffer[first : first + part.size].view(dtype).reshape(node["shape"])
        if "dataclass" in node:
            cls, init = _dataclass_type(node["dataclass"])
            values = {name: build(value) for name, value in node["fields"].items()}
            obj = cls(**{k: v for k, v in values.items() if k in init})
            for name, value in values.items():
                if name not in init:  # init=False fields are set as they were
                    object.__setattr__(obj, name, value)
            return obj
        if "list" in node:
            return [build(item) for item in node["list"]]
        return tuple(build(item) for item in node["tuple"])

    return build(description)
