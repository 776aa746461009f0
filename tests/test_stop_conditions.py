"""Requests end where they should: max_tokens, EOS, stop token ids, stop
strings (matched across token boundaries, never in the text), the context."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve import LLM, SamplingParams
from aioserve.scheduler import RequestRejected

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path: Path):
    llm = LLM(str(stories_path), page_size=4, debug_integrity=True)
    yield llm
    llm.scheduler.check_integrity()
    llm.close()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **kwargs)


def test_max_tokens(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy(max_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_end_generation(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_tokens=32))[0].token_ids
    stop_at = full[10]  # "Lily" or so: a token whose first occurrence we know
    out = llm.generate(PROMPT, greedy(max_tokens=32, stop_token_ids=[stop_at]))[0]
    first = full.index(stop_at)
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"


def test_eos_and_ignore_eos(llm: LLM) -> None:
    # stories260K never emits its EOS (2) on its own; a bias makes it.
    out = llm.generate(PROMPT, greedy(max_tokens=10, logit_bias={2: 100.0}))[0]
    assert out.token_ids == [2] and out.finish_reason == "stop" and out.text == ""
    ignored = llm.generate(PROMPT, greedy(max_tokens=10, logit_bias={2: 100.0}, ignore_eos=True))[0]
    assert ignored.token_ids == [2] * 10 and ignored.finish_reason == "length"


def test_min_tokens_holds_back_an_eos_that_would_win(llm: LLM) -> None:
    # The bias makes EOS the greedy choice at every step (the test above shows
    # it ends the request at once); min_tokens N must forbid it for exactly N
    # tokens, which are then the unbiased greedy ones, and EOS comes next.
    plain = llm.generate(PROMPT, greedy(max_tokens=8))[0].token_ids
    for n in (1, 4):
        out = llm.generate(PROMPT, greedy(max_tokens=8, logit_bias={2: 100.0}, min_tokens=n))[0]
        assert out.token_ids == plain[:n] + [2] and out.finish_reason == "stop"
    # Stop token ids are held back the same way (" Once": greedy would not pick it here).
    stop_at = 403
    assert stop_at not in plain[:3]
    out = llm.generate(PROMPT, greedy(max_tokens=8, logit_bias={stop_at: 100.0}, stop_token_ids=[stop_at], min_tokens=2))[0]
    assert out.token_ids == plain[:2] + [stop_at] and out.finish_reason == "stop"


def test_stop_string_across_tokens_is_cut_from_the_text(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_tokens=32))[0]
    assert "girl named Lily" in full.text
    # "l named L" spans several tokens (" girl", " named", " Lily").
    out = llm.generate(PROMPT, greedy(max_tokens=32, stop=["l named L", "zzz"]))[0]
    assert out.text == full.text[: full.text.index("l named L")]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 32
    kept = llm.generate(PROMPT, greedy(max_tokens=32, stop=["l named L"], include_stop_str_in_output=True))[0]
    assert kept.text == full.text[: full.text.index("l named L") + len("l named L")]


def test_context_limit_ends_generation(stories_path: Path) -> None:
    llm = LLM(str(stories_path), max_model_len=40, page_size=4)
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], greedy(max_tokens=None))[0]
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"
    with pytest.raises(RequestRejected, match="maximum context length is 40"):
        llm.generate([prompt * 8], greedy(max_tokens=4))
    with pytest.raises(RequestRejected, match="max_tokens"):
        llm.generate([prompt], greedy(max_tokens=36))
    llm.close()


def test_multibyte_text_is_detokenized_whole(llm: LLM) -> None:
    # Byte fallback: an emoji is four <0x..> tokens; the stream holds the
    # partial bytes back and emits the character once it is complete.
    from aioserve.output_stream import OutputStream
    from aioserve.scheduler import RequestEvent

    ids = llm.tokenizer.encode("a 🙂 b", add_special_tokens=False)
    stream = OutputStream(llm.tokenizer, llm.tokenizer.encode(PROMPT), SamplingParams())
    deltas = [stream.add(RequestEvent(token_id=t, logprob=0.0)).text for t in ids]
    assert "".join(deltas) == " a 🙂 b"
    assert "\ufffd" not in "".join(deltas)
    assert deltas.count("") >= 3  # the emoji's first three bytes emit nothing yet


def test_output_stream_ends_the_request_once_at_a_stop_string(llm: LLM) -> None:
    from aioserve.output_stream import OutputStream
    from aioserve.scheduler import RequestEvent

    full = llm.generate(PROMPT, greedy(max_tokens=32))[0]
    ended: list[bool] = []
    params = greedy(stop=["zzz", "l named L"])
    stream = OutputStream(llm.tokenizer, llm.tokenizer.encode(PROMPT), params, end_request=lambda: ended.append(True))
    for token_id in full.token_ids:  # the scheduler may still send tokens computed after the stop
        stream.add(RequestEvent(token_id=token_id, logprob=0.0))
    stream.add(RequestEvent(finish_reason="stop"))  # the abort's echo
    assert ended == [True]
    assert stream.text == full.text[: full.text.index("l named L")]
    assert stream.finish_reason == "stop" and stream.matched_stop == "l named L"
    assert len(stream.token_ids) < len(full.token_ids)


def test_text_offsets_follow_the_detokenized_text(llm: LLM) -> None:
    from aioserve.output_stream import OutputStream
    from aioserve.scheduler import RequestEvent

    ids = llm.tokenizer.encode("a 🙂 b", add_special_tokens=False)
    stream = OutputStream(llm.tokenizer, llm.tokenizer.encode(PROMPT), SamplingParams())
    for token_id in ids:
        stream.add(RequestEvent(token_id=token_id, logprob=0.0))
    assert stream.text == " a 🙂 b"
    # The emoji's four byte tokens all start where the emoji does.
    assert stream.text_offsets == [0, 2, 3, 3, 3, 3, 4]
    # A stop token id is what matched.
    stream.add(RequestEvent(token_id=2, logprob=0.0, finish_reason="stop"))
    assert stream.matched_stop == 2 and stream.text_offsets[-1] == len(stream.text)
