"""Checks on a parsed JSON request body that come before pydantic sees it:
its shape (nesting depth, values in its objects and arrays), the
per-request bounds (prompts × n, messages, token ids, logit_bias entries,
stop strings, tools), the response's estimated cost (cost.py) and lone
surrogates.

Standard library only, and nothing of aioserve: server/body/worker.py, a
plain-Python process that parses large bodies away from the event loop, runs
them too (importing aioserve would pull in torch). A body over a bound is
refused on a few len() calls, before the work it asks for is validated or
built: `{"prompt": ["a"] * 10000, "n": 128}` would be 1.28 million
scheduler requests."""

from __future__ import annotations

import re
from collections.abc import Sized
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # in the server, and as the type checker reads it
    from aioserve.server.body.cost import estimate
else:  # body/worker.py runs this as a plain script beside cost.py
    from cost import estimate


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: ServerArgs' fields of the same names,
    and the model's context."""

    max_choices_per_request: int
    max_messages_per_request: int
    max_token_ids_per_request: int
    max_logit_bias_entries: int
    max_stop_sequences: int
    max_tools_per_request: int
    max_logprob_entries_per_request: int
    max_response_tokens_per_request: int
    max_json_depth: int
    max_json_values: int
    max_model_len: int = 0  # the model's context (ServingContext's); 0: unknown

    def as_dict(self) -> dict[str, int]:
        """Plain data for the worker process (which cannot unpickle this class)."""
        return asdict(self)


class BodyRejected(Exception):
    """A 400, described with plain data (the worker sends it back pickled)."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _over(what: str, count: int, limit: int, option: str, param: str) -> BodyRejected:
    return BodyRejected(
        f"{what}: {count}, more than this server's limit of {limit} per request "
        f"(--{option.replace('_', '-')} raises it)",
        param,
        "request_too_large",
    )


def check_sizes(data: dict[str, Any], limits: RequestLimits) -> None:
    """Raise BodyRejected for the first bound the body breaks. Shapes that are
    wrong (a string where a list belongs) are left to pydantic's validation."""
    sampling = data.get("sampling_params")  # /generate nests these
    sampling = sampling if isinstance(sampling, dict) else {}
    _check_prompts(data.get("prompt"), _n(data), limits, "prompt")
    _check_prompts(data.get("input_ids"), _n(sampling), limits, "input_ids")  # /generate
    _check_token_list(data.get("tokens"), limits, "tokens")  # /detokenize
    for fields, prefix in ((data, ""), (sampling, "sampling_params.")):
        _check_len(fields.get("logit_bias"), dict, limits.max_logit_bias_entries, "logit_bias entries",
                   "max_logit_bias_entries", prefix + "logit_bias")
        _check_len(fields.get("stop"), list, limits.max_stop_sequences, "stop sequences",
                   "max_stop_sequences", prefix + "stop")
        _check_token_list(fields.get("stop_token_ids"), limits, prefix + "stop_token_ids")
    _check_len(data.get("messages"), list, limits.max_messages_per_request, "messages",
               "max_messages_per_request", "messages")
    _check_len(data.get("tools"), list, limits.max_tools_per_request, "tools", "max_tools_per_request", "tools")
    text = data.get("text")  # /generate's batch of texts
    if isinstance(text, list):
        _check_choices(len(text), _n(sampling), limits, "text")
    _check_response_cost(data, limits)


def _check_response_cost(data: dict[str, Any], limits: RequestLimits) -> None:
    """Each bound above holds alone; their product, the response, is
    estimated (cost.py) and held to its budgets before anything is built."""
    cost = estimate(data, limits.max_model_len)
    if cost.logprob_entries > limits.max_logprob_entries_per_request:
        raise BodyRejected(
            f"this response would hold up to {cost.logprob_entries} logprob entries (prompts × n × (echoed "
            f"prompt + max tokens) × (1 + top logprobs)), more than this server's limit of "
            f"{limits.max_logprob_entries_per_request} (--max-logprob-entries-per-request raises it)",
            "logprobs", "request_too_large",
        )
    if cost.text_tokens > limits.max_response_tokens_per_request:
        unset = (f"; max_tokens unset counts as the model's context of {limits.max_model_len} tokens, "
                 "setting it lowers the estimate") if cost.output_unset else ""
        raise BodyRejected(
            f"this response would hold up to {cost.text_tokens} tokens of text (prompts × n × (echoed prompt "
            f"+ max tokens), a prompt's tokens counted as its characters), more than this server's limit of "
            f"{limits.max_response_tokens_per_request} (--max-response-tokens-per-request raises it){unset}",
            cost.text_param, "request_too_large",
        )


# Token-id lists, bounded by max_token_ids_per_request (and prompts × n), not
# counted as values: a 128K-token prompt is one legitimate list.
TOKEN_ID_FIELDS = frozenset({"prompt", "input_ids", "tokens", "stop_token_ids"})


def check_shape(data: dict[str, Any], limits: RequestLimits) -> None:
    """Bound every free-form JSON value of the body (a schema, tool
    parameters, chat_template_kwargs, Responses input items) by its nesting
    and its number of values, walked without recursion: what pydantic,
    a template or a grammar compiler would otherwise take seconds over, or
    recurse into until a RecursionError."""
    stack: list[tuple[Any, int]] = [
        (value, 1) for key, value in data.items() if key not in TOKEN_ID_FIELDS and key != "sampling_params"
    ]
    sampling = data.get("sampling_params")
    if isinstance(sampling, dict):
        stack += [(value, 2) for key, value in sampling.items() if key not in TOKEN_ID_FIELDS]
    values = 0
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            items: Any = value.values()
        elif isinstance(value, list):
            items = value
        else:
            continue
        if depth > limits.max_json_depth:
            raise _too_deep(limits)
        values += len(items)
        if values > limits.max_json_values:
            raise _over("too many values in the request body's objects and arrays", values,
                        limits.max_json_values, "max_json_values", "body")
        stack += [(item, depth + 1) for item in items if isinstance(item, (dict, list))]


def text_chars(value: Any) -> int:
    """Characters of every string in a JSON value, keys included, walked
    without recursion: the text a chat template may be handed."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) for key in item if isinstance(key, str))
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return total


def _too_deep(limits: RequestLimits) -> BodyRejected:
    return BodyRejected(
        f"the request body nests objects and arrays more than {limits.max_json_depth} deep "
        "(--max-json-depth raises it)", None, "request_too_large",
    )


def _n(fields: dict[str, Any]) -> int:
    n = fields.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def prompt_count(prompt: Any) -> int:
    """How many prompts a validated prompt field holds (a string or token ids:
    one; else a list of them), before any is tokenized."""
    return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else max(len(prompt), 1)


def _check_len(value: Any, kind: type[Sized], limit: int, what: str, option: str, param: str) -> None:
    if isinstance(value, kind) and len(value) > limit:
        raise _over(f"too many {what}", len(value), limit, option, param)


def _check_choices(prompts: int, n: int, limits: RequestLimits, param: str) -> None:
    if prompts * n > limits.max_choices_per_request:
        raise _over(
            f"too many choices ({prompts} prompts × n={n}, each one generation)", prompts * n,
            limits.max_choices_per_request, "max_choices_per_request", param,
        )


def _check_token_list(value: Any, limits: RequestLimits, param: str) -> None:
    _check_len(value, list, limits.max_token_ids_per_request, "token ids", "max_token_ids_per_request", param)


def _check_prompts(prompt: Any, n: int, limits: RequestLimits, param: str) -> None:
    """A string, a list of token ids, or a list of either (each a prompt)."""
    if not isinstance(prompt, list) or not prompt:
        return
    if not isinstance(prompt[0], list) and not isinstance(prompt[0], str):  # one prompt of token ids
        _check_token_list(prompt, limits, param)
        return
    _check_choices(len(prompt), n, limits, param)
    ids = sum(len(item) for item in prompt if isinstance(item, list))
    if ids > limits.max_token_ids_per_request:
        raise _over("too many token ids", ids, limits.max_token_ids_per_request, "max_token_ids_per_request", param)


# JSON may spell half of a UTF-16 pair alone ("\\ud800"); Python keeps it in
# the string, and the tokenizer then fails on it. Only bodies that contain
# such an escape (or, since json.loads decodes bytes with surrogatepass, one
# encoded raw) are walked.
ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def check_surrogates(value: object, path: list[str]) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BodyRejected("text must be valid Unicode: it holds a lone surrogate", ".".join(path) or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_surrogates(key, path)
            check_surrogates(item, [*path, str(key)])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_surrogates(item, [*path, str(index)])


def decode(raw: bytes, limits: RequestLimits, known_fields: frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """The body as a dict of the model's known fields (others are ignored, as
    OpenAI's server ignores them; their names come back for the log), after
    every check above. Raises BodyRejected."""
    import json

    try:
        data = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's 4300 digits
        raise BodyRejected(f"the request body is not valid JSON: {exc}", None) from None
    except RecursionError:  # deeper than the parser goes (~1000), past any --max-json-depth
        raise _too_deep(limits) from None
    if not isinstance(data, dict):
        raise BodyRejected("the request body must be a JSON object", None)
    unknown = [name for name in data if name not in known_fields]
    for name in unknown:
        del data[name]
    check_sizes(data, limits)  # first: its bounds name the field and the option that raise them
    check_shape(data, limits)
    if ESCAPED_SURROGATE.search(raw):
        check_surrogates(data, [])
    return data, unknown
