"""Constrained decoding end to end through the offline API, on random-weight
models with the real Qwen3 and Llama 3 vocabularies, sampled at temperature 1
over many seeds: every output that finishes validates (JSON schema), fully
matches (regex) or is one of the choices; free requests batched with
constrained ones are unchanged; seeds reproduce; overlap on and off agree.

Random weights rarely close a JSON string by themselves: the tests bias the
`"` token (and `\\`, for escapes) so that strings end after a few tokens, and
check that enough outputs finish with "stop".
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from aioserve import LLM, SamplingParams
from aioserve.grammar import GrammarError
from aioserve.sampling_params import StructuredOutputParams
from conftest import SHARED
from real_vocab_models import real_vocab_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string"},
        "score": {"type": "number", "minimum": -100, "maximum": 100},
        "kind": {"enum": ["cat", "dog", "é世 \"q\""]},
        "owner": {
            "type": "object",
            "properties": {"nick": {"type": "string", "maxLength": 6}, "vip": {"type": "boolean"}},
            "required": ["nick", "vip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["id", "name", "score", "kind", "owner", "tags"],
}
REGEX = r"[a-z]{2,6}-\d{1,3}(\.[A-Z])?"
CHOICES = ["yes", "no", "maybe so", "peut-être ✓"]
PROMPT = "Write a record:"
SEEDS = range(16)


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def llm(request, tmp_path_factory) -> LLM:
    path = real_vocab_checkpoint(request.param, SHARED, tmp_path_factory.getbasetemp())
    llm = LLM(str(path), device="cpu", num_pages=1500)
    yield llm
    llm.close()


def string_bias(llm: LLM) -> dict[int, float]:
    """Make `"` likely enough that strings close, and `\\` that escapes appear."""
    quote, backslash = (llm.tokenizer.encode(c, add_special_tokens=False) for c in ('"', "\\"))
    return {quote[0]: 9.0, backslash[0]: 5.0}


def constrained(llm: LLM, spec: StructuredOutputParams, seed: int, max_tokens: int = 160, **extra) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=spec, logit_bias=string_bias(llm), **extra
    )


def is_prefix(llm: LLM, spec: StructuredOutputParams, text: str) -> bool:
    """Whether `text` can still be completed under the grammar (for outputs cut by max_tokens)."""
    from aioserve.grammar import compiler_for

    grammar = compiler_for(llm.tokenizer, llm.engine.vocab_size).compile(spec)
    return xgr.GrammarMatcher(grammar.compiled).accept_string(text)


def test_json_schema_outputs_validate(llm: LLM) -> None:
    spec = StructuredOutputParams(json=SCHEMA)
    outputs = llm.generate([PROMPT] * len(SEEDS), [constrained(llm, spec, seed) for seed in SEEDS])
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert len(finished) >= len(SEEDS) // 2, [o.finish_reason for o in outputs]
    for output in finished:
        jsonschema.validate(json.loads(output.text), SCHEMA)
    for output in outputs:
        if output.finish_reason == "length":
            assert len(output.token_ids) == 160 and is_prefix(llm, spec, output.text)
    texts = "".join(o.text for o in finished)
    assert "\\" in texts, "no escape sequence in any output"
    assert any(ord(ch) > 127 for ch in "".join(json.loads(o.text)["name"] for o in finished)), "no non-ASCII text"


def test_json_object_regex_and_choice(llm: LLM) -> None:
    specs = [StructuredOutputParams(json_object=True), StructuredOutputParams(regex=REGEX),
             StructuredOutputParams(choice=CHOICES)]
    params = [constrained(llm, spec, seed, max_tokens=64) for spec in specs for seed in SEEDS]
    outputs = llm.generate([PROMPT] * len(params), params)
    objects, regexes, choices = (outputs[i * len(SEEDS) : (i + 1) * len(SEEDS)] for i in range(3))
    finished_objects = [o for o in objects if o.finish_reason == "stop"]
    assert len(finished_objects) >= 4
    assert all(isinstance(json.loads(o.text), dict) for o in finished_objects)
    assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text) for o in regexes), [o.text for o in regexes]
    assert all(o.finish_reason == "stop" and o.text in CHOICES for o in choices), [o.text for o in choices]


def test_free_requests_are_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    free = [SamplingParams(max_tokens=24, temperature=0.0) for _ in range(3)]
    prompts = ["Once upon a time", "The weather today", "def main():"]
    alone = llm.generate(prompts, free)
    spec = StructuredOutputParams(json=SCHEMA)
    mixed = llm.generate(prompts + [PROMPT] * 6, free + [constrained(llm, spec, seed, max_tokens=40) for seed in range(6)])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]


def test_seeds_logprobs_stops_and_limits(llm: LLM) -> None:
    spec = StructuredOutputParams(json=SCHEMA)
    first = llm.generate([PROMPT] * 3, [constrained(llm, spec, seed, logprobs=2) for seed in (1, 2, 3)])
    # The same seeds give the same outputs. (Not checked across different
    # batches: at temperature 1 over a near-flat 150k-token distribution, the
    # last-bit differences of another batch size's matmul move the draw.)
    again = llm.generate([PROMPT] * 3, [constrained(llm, spec, seed, logprobs=2) for seed in (1, 2, 3)])
    assert [o.text for o in first] == [o.text for o in again]
    assert len({o.text for o in first}) == 3
    for output in first:
        assert len(output.logprobs) == len(output.top_logprobs) == len(output.token_ids)
        assert all(len(top) == 2 for top in output.top_logprobs)
    # A stop string ends a constrained output where it first appears.
    stopped = llm.generate([PROMPT], [constrained(llm, spec, 1, stop=[", \"score\""])])[0]
    assert stopped.finish_reason == "stop" and stopped.text == first[0].text.split(', "score"')[0]
    # max_tokens ends it with "length", a valid prefix.
    short = llm.generate([PROMPT], [constrained(llm, spec, 1, max_tokens=5)])[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    assert first[0].text.startswith(short.text)


def test_grammars_that_do_not_compile_are_refused(llm: LLM) -> None:
    for spec, kind in ((StructuredOutputParams(regex="[a-"), "regex"), (StructuredOutputParams(json='{"type": 5'), "json"),
                       (StructuredOutputParams(json={"type": "frobnicate"}), "json"),
                       (StructuredOutputParams(grammar="root ::= "), "grammar")):
        with pytest.raises(GrammarError) as error:
            llm.generate([PROMPT], [SamplingParams(structured_outputs=spec)])
        assert error.value.kind == kind
    assert not llm.scheduler.has_work


def test_compiled_grammars_are_cached_by_constraint(llm: LLM) -> None:
    from aioserve.grammar import compiler_for

    compiler = compiler_for(llm.tokenizer, llm.engine.vocab_size)
    first = compiler.compile(StructuredOutputParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    hits = compiler.hits
    again = compiler.compile(StructuredOutputParams(json='{"type":"object",  "properties":{"a":{"type":"integer"}}}'))
    assert again is first and compiler.hits == hits + 1
    other = compiler.compile(StructuredOutputParams(json={"type": "object", "properties": {"b": {"type": "integer"}}}))
    assert other is not first


def test_overlap_on_and_off_agree(tmp_path_factory) -> None:
    """The mask of each step comes from the tokens before it, with or without
    overlap: seeded outputs are identical."""
    path = real_vocab_checkpoint("qwen3", SHARED, tmp_path_factory.getbasetemp())
    spec = StructuredOutputParams(json=SCHEMA)
    results = []
    for overlap in (True, False):
        llm = LLM(str(path), device="cpu", num_pages=600, overlap=overlap)
        try:
            params = [constrained(llm, spec, seed, max_tokens=60) for seed in range(4)]
            free = [SamplingParams(max_tokens=30, temperature=1.0, seed=7)]
            results.append([o.token_ids for o in llm.generate([PROMPT] * 5, params + free)])
        finally:
            llm.close()
    assert results[0] == results[1]


def test_constrained_requests_under_overlap(tmp_path_factory) -> None:
    """A constrained request needs its previous token for its mask: among
    mostly free requests it decodes every other step; when constrained
    requests are at least half, the loop waits for each step instead and
    nobody skips."""
    path = real_vocab_checkpoint("qwen3", SHARED, tmp_path_factory.getbasetemp())
    llm = LLM(str(path), device="cpu", num_pages=600)
    sizes: list[int] = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        step = schedule()
        if step is not None:
            sizes.append(len(step.entries))
        return step

    llm.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    try:
        spec = StructuredOutputParams(regex="[a-z]{300}")  # never ends before max_tokens
        tokens = 12

        def step_sizes(constrained_count: int, free_count: int) -> list[int]:
            params = [SamplingParams(max_tokens=tokens, seed=i, structured_outputs=spec) for i in range(constrained_count)]
            params += [SamplingParams(max_tokens=3 * tokens, temperature=0, ignore_eos=True) for _ in range(free_count)]
            sizes.clear()
            outputs = llm.generate(["Spell:"] * len(params), params)
            assert [len(o.token_ids) for o in outputs] == [tokens] * constrained_count + [3 * tokens] * free_count
            return list(sizes)

        # 1 of 4 constrained: it is in every other step (the free ones in all).
        assert step_sizes(1, 3)[: 2 * tokens - 1] == [4, 3] * (tokens - 1) + [4]
        # 2 of 4: every step has all four until the constrained ones finish.
        assert step_sizes(2, 2)[:tokens] == [4] * tokens
        assert step_sizes(3, 0) == [3] * tokens
    finally:
        llm.close()


def test_bounded_json_strings_admit_escapes_and_no_raw_control_characters() -> None:
    """The grammar of a maxLength string (grammar/json_strings.py): a raw TAB
    or NUL is refused, its escape is taken and counts as one character."""
    import xgrammar as xgr

    from aioserve.grammar.json_strings import strict_json_schema_grammar

    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]})
    grammar = strict_json_schema_grammar(schema)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\t", "\x00"])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('{"s": "a\\tb"}') and accepts('{"s": "\\u0000xy"}') and accepts('{"s": "abc"}')
    assert not accepts('{"s": "a\tb"}') and not accepts('{"s": "a\x00"}')
    assert not accepts('{"s": "abcd"}') and not accepts('{"s": "\\t\\t\\t\\t"}')  # four characters, escaped or not
