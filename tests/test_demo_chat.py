"""Chat on the built-in demo model: stories260K ships a plain transcript chat
template (aioserve/demo_model/tokenizer_config.json), so chat completions and
the README's "Talk to it" snippet work on the default server as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import httpx

from aioserve.tokenizer import Tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_template_frames_the_turns_as_a_transcript(stories_path: Path) -> None:
    tokenizer = Tokenizer(stories_path, workers=1)
    try:
        messages = [
            {"role": "system", "content": "Tell short stories."},
            {"role": "user", "content": "Tell me about a cat."},
            {"role": "assistant", "content": "Once there was a cat."},
            {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
        ]
        text = tokenizer.render_chat(messages)
        assert text == (
            "<s>Tell short stories.\nUser: Tell me about a cat.\nAssistant: Once there was a cat.\n"
            "User: And then?\nAssistant:"
        )
        ids = tokenizer.encode_chat(messages)
        assert ids[0] == 1 and ids.count(1) == 1  # BOS once: the template writes it, encoding adds none
    finally:
        tokenizer.shutdown()


def test_chat_completions_on_the_default_model(stories_server, stories_client, stories_model) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    reply = stories_client.chat.completions.create(model=stories_model, messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    # The prompt is the rendered transcript: its tokens equal the template's.
    rendered = httpx.post(
        f"{stories_server.url}/tokenize", json={"prompt": "<s>User: Tell me a story.\nAssistant:", "add_special_tokens": False}, timeout=30
    ).json()
    assert reply.usage.prompt_tokens == rendered["count"]

    streamed = stories_client.chat.completions.create(
        model=stories_model, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == reply.choices[0].message.content


def test_the_readme_snippet_runs_as_written(stories_server) -> None:
    section = README.read_text().split("## Talk to it", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'base_url="http://127.0.0.1:8000/v1"' in snippet
    snippet = snippet.replace("http://127.0.0.1:8000/v1", stories_server.v1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    story, chat = out.getvalue().split("\n", 1)
    assert story.strip() and chat.strip()
