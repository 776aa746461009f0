"""A response model's JSON in slices: the same bytes as model_dump_json(),
made by many short serializer calls instead of one long one.

pydantic serializes a model in one Rust call that holds the GIL throughout:
a response at the logprob budget (a million entries, ~20-30 MB) held it
for 0.7-1.2 s, and no thread can break into that call, the event loop's
included. Here a model whose lists are long is written field by field, and
a long list a bounded number of items at a time, each piece by pydantic
with the field's own type (so nulls for non-finite floats and every
serializer of the models are as they were); between pieces the GIL can
go to the loop. assembly.py runs it on a thread of its own for a large
response; tests/test_sliced_json.py holds it byte-equal to model_dump_json."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, PydanticUserError, RootModel, TypeAdapter

# Values (numbers, strings, entries of objects and arrays) one serializer
# call writes at most: ~20 ms of pydantic's time (a response's logprobs
# took ~1.2 µs a value).
SLICE_VALUES = 16384

# WireModel's own setting, for the lists written apart from their model.
_CONFIG = ConfigDict(ser_json_inf_nan="null")


def sliced_json(body: BaseModel) -> list[bytes]:
    """The pieces of body.model_dump_json(), encoded, in order."""
    out: list[bytes] = []
    _model(body, out)
    return out


# A list of models up to this long is weighed item by item (choices differ:
# one prompt echoed may be far longer than another); a longer one (chat's
# logprob entries, alike) by its first item, so that weighing stays cheap.
WEIGHED_ITEMS = 1024
SAMPLED_ITEMS = 8  # a list of alike items is weighed by the heaviest of its first few


def weight(value: Any) -> int:
    """Values in `value`, about: what one serializer call would write. A
    short list of models is weighed item by item, a longer one or a list of
    plain values (alike: logprob entries) by its first few items."""
    if isinstance(value, RootModel):
        return weight(value.root)
    if isinstance(value, BaseModel):
        return 1 + sum(weight(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], BaseModel) and len(value) <= WEIGHED_ITEMS:
            return 1 + sum(weight(item) for item in value)
        return 1 + len(value) * _item_weight(value)
    if isinstance(value, dict):
        return 1 + len(value)
    return 1


def _item_weight(items: list[Any] | tuple[Any, ...]) -> int:
    """An item's weight in a list of alike items, from its first few (the
    first may be a null: a prompt's first token has no logprobs)."""
    return max((weight(item) for item in items[:SAMPLED_ITEMS]), default=0)


def _model(model: BaseModel, out: list[bytes]) -> None:
    if weight(model) <= SLICE_VALUES or _serializes_fields(type(model)):
        out.append(model.model_dump_json().encode())
        return
    if isinstance(model, RootModel):
        _list(model.root, type(model).model_fields["root"].annotation, out)
        return
    # Field by field, in their order: runs of light fields in one call (the
    # model's serializer leaves out what it omits), heavy ones apart.
    out.append(b"{")
    wrote, light = False, []
    fields = type(model).model_fields
    for name in [*fields, None]:
        value = getattr(model, name) if name is not None else None
        if name is not None and (weight(value) <= SLICE_VALUES or not isinstance(value, (BaseModel, list))):
            light.append(name)
            continue
        if light:
            inner = model.model_dump_json(include=set(light)).encode()[1:-1]
            if inner:
                out.append(b"," + inner if wrote else inner)
                wrote = True
            light = []
        if name is not None:
            out.append((b"," if wrote else b"") + json.dumps(name).encode() + b":")
            wrote = True
            if isinstance(value, BaseModel):
                _model(value, out)
            elif isinstance(value, list):  # what else is heavy (see the test above)
                _list(value, fields[name].annotation, out)
    out.append(b"}")


def _list(items: list[Any], annotation: Any, out: list[bytes]) -> None:
    """A list a slice of items at a time, an item heavier than a slice apart."""
    adapter = _adapter(annotation)
    out.append(b"[")
    pieces = 0

    def write(chunk: list[Any]) -> None:
        nonlocal pieces
        if chunk:
            out.append((b"," if pieces else b"") + adapter.dump_json(chunk)[1:-1])
            pieces += 1

    if items and isinstance(items[0], BaseModel) and len(items) <= WEIGHED_ITEMS:
        chunk: list[Any] = []
        chunk_weight = 0
        for item in items:
            item_weight = weight(item)
            if chunk_weight + item_weight > SLICE_VALUES:
                write(chunk)
                chunk, chunk_weight = [], 0
            if item_weight > SLICE_VALUES:
                out.append(b"," if pieces else b"")
                _model(item, out)
                pieces += 1
            else:
                chunk.append(item)
                chunk_weight += item_weight
        write(chunk)
    else:
        step = max(1, SLICE_VALUES // max(1, _item_weight(items)))
        for start in range(0, len(items), step):
            write(items[start : start + step])
    out.append(b"]")


@lru_cache(maxsize=None)
def _serializes_fields(model: type[BaseModel]) -> bool:
    """A model with serializers or aliases of its own fields is written whole:
    writing its fields apart would pass them by."""
    decorators = model.__pydantic_decorators__
    aliased = any(f.alias or f.serialization_alias for f in model.model_fields.values())
    return bool(decorators.field_serializers) or aliased


@lru_cache(maxsize=64)
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    """The serializer of a list field's type, as its model writes it."""
    try:
        return TypeAdapter(annotation, config=_CONFIG)
    except PydanticUserError:  # a type with a config of its own takes no other
        return TypeAdapter(annotation)
