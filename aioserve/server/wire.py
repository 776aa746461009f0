"""The base of every response model: JSON as clients read it.

OpenAI's objects hold two kinds of optional fields: ones that are always
present and may be null (`logprobs`, `finish_reason`, `message.refusal`) and
ones that are left out unless they have a value (`usage` on a stream chunk,
`delta.role`). A model lists the second kind in `omit_when_none`; everything
else is always written.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer
from starlette.responses import Response


class WireModel(BaseModel):
    # Non-finite floats (a -inf logprob) become null: JSON has no infinity.
    model_config = ConfigDict(ser_json_inf_nan="null")

    omit_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_when_none:
            if data.get(name, 0) is None:
                del data[name]
        return data

    def json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def json_response(body: BaseModel, status: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")
