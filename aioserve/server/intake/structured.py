"""Constrained decoding as clients ask for it, and its grammar.

Three spellings reach one StructuredOutputParams:
* OpenAI's `response_format`: {"type": "json_object"} or {"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}};
* vLLM's `structured_outputs`: {json | regex | choice | grammar | json_object};
* vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
  `guided_grammar`, which vLLM 0.12 dropped (silently: a 200 with free text)
  and which many clients still send: honoured here.
At most one of them may be given (SGLang's /generate has its own three,
json_schema, regex and ebnf, checked here alike). The grammar is compiled
on the tokenizer's thread pool (cached by constraint); one that does not
compile is a 400 naming the field it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import MutableMapping
from typing import Any

from aioserve.grammar import CompiledGrammar, GrammarBudget, GrammarError, compiler_for
from aioserve.sampling_params import SamplingParamsError, StructuredOutputParams
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.openai_requests import SamplingFields


@dataclass
class StructuredRequest:
    spec: StructuredOutputParams
    param: str  # the request field it came from, for errors


def structured_request(body: SamplingFields) -> StructuredRequest | None:
    """The constraint a completions or chat body asks for, if any."""
    found: list[StructuredRequest] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredRequest(StructuredOutputParams(json_object=True), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if schema is None:
            raise APIError("response_format json_schema needs json_schema.schema", param="response_format.json_schema")
        found.append(StructuredRequest(StructuredOutputParams(json=schema), "response_format.json_schema.schema"))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        given: dict[str, Any] = {  # each value the type of its StructuredOutputParams field
            "json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
            "json_object": True if so.json_object else None,
        }
        named = [name for name, value in given.items() if value is not None]
        if len(named) != 1:
            raise APIError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        spec = StructuredOutputParams(**{named[0]: given[named[0]]})
        found.append(StructuredRequest(spec, f"structured_outputs.{named[0]}"))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            found.append(StructuredRequest(StructuredOutputParams(**{kind: value}), field))
    return one_constraint(found, f"give one output constraint: {', '.join(f.param for f in found)} were all given")


def one_constraint(found: list[StructuredRequest], too_many: str) -> StructuredRequest | None:
    """The one place every route's constraint is checked (/generate's too):
    at most one given (`too_many` says so otherwise), and its spec valid by
    StructuredOutputParams' own rules, before any grammar is compiled; a
    400 names the field it came from."""
    if len(found) > 1:
        raise APIError(too_many, param=found[1].param)
    if not found:
        return None
    try:
        found[0].spec.validate()
    except SamplingParamsError as exc:
        raise APIError(str(exc), param=found[0].param) from None
    return found[0]


async def compile_grammar(
    ctx: ServingContext, request: StructuredRequest | None, scope: MutableMapping[str, Any]
) -> CompiledGrammar | None:
    """The request's grammar, compiled on the grammar workers; while it
    compiles the request does not count against --max-waiting-requests
    (`scope` holds its reservation)."""
    if request is None:
        return None
    held = ctx.set_aside(scope)
    try:
        budget = GrammarBudget(ctx.args.max_grammar_chars, ctx.args.grammar_compile_timeout)
        compiled = await compiler_for(ctx.tokenizer, ctx.vocab_size, budget).compile_async(request.spec)
    except GrammarError as exc:
        raise APIError(str(exc), param=request.param) from None
    ctx.take_back(held, scope)
    return compiled
