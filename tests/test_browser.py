"""The chat page at GET /, in headless Chromium (Debian's package, driven by
Playwright): streaming, stop, the API key, the completion fallback for a model
without a chat template, and that model text never becomes markup.

AIOSERVE_SCREENSHOT=path keeps the mid-stream screenshot (docs/chat-page.png
comes from it); AIOSERVE_CHROMIUM=path picks another Chromium binary."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from server_harness import RunningServer, start_server

STATIC = Path(__file__).resolve().parents[1] / "aioserve" / "server" / "endpoints" / "static"
KEY = "page-s3cret"
STATS = re.compile(r"^\d+ tokens? · ([\d.]+|–) tokens/s · time to first token \d+ ms$")

# Records the reply's text length at every animation frame, i.e. at each paint.
SAMPLE_PAINTS = """() => {
  window.__lengths = [];
  const tick = () => {
    const text = document.querySelector("#transcript .turn.reply:last-child .text");
    if (text) window.__lengths.push(text.textContent.length);
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


def find_chromium() -> str | None:
    candidates = [os.environ.get("AIOSERVE_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="module")
def browser():
    path = find_chromium()
    if path is None:
        pytest.skip("Chromium not found: `apt-get install -y chromium` (.ci/run does it when it runs as root)")
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture()
def page(browser: Browser):
    context = browser.new_context(viewport={"width": 880, "height": 620})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert errors == [], f"the page's script failed: {errors}"


@pytest.fixture(scope="module")
def keyed_server(templateless_stories_path: Path):
    # On the CPU even where there is a GPU: the reply must last long enough to
    # watch it grow and press Stop mid-stream. Without a chat template: the
    # page's completion mode.
    server = start_server(
        templateless_stories_path, "--api-key", KEY, "--served-model-name", "stories260K", "--page-size", "4", "--device", "cpu"
    )
    yield server
    server.stop()


def send(page: Page, prompt: str, max_tokens: int, temperature: float) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#prompt", prompt)
    page.click("#send")


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_page_and_its_files_are_served(stories_server: RunningServer) -> None:
    page = httpx.get(stories_server.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text), "the page must load nothing from elsewhere"
    for name, kind in (("chat.js", "javascript"), ("chat.css", "text/css")):
        response = httpx.get(f"{stories_server.url}/static/{name}", timeout=30)
        assert response.status_code == 200 and kind in response.headers["content-type"]
    script = (STATIC / "chat.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, f"chat.js uses {sink}: model text could become markup"


def test_stream_then_stop(page: Page, keyed_server: RunningServer, tmp_path: Path) -> None:
    """stories260K without a chat template (completion mode, known before the
    first prompt), an API key, a long reply that grows paint by paint until
    Stop aborts it on the server."""
    responses: list[tuple[str, int]] = []
    page.on("response", lambda response: responses.append((response.url, response.status)))
    page.goto(keyed_server.url)
    expect(page.locator("#model")).to_have_text("this server wants an API key")
    expect(page.locator("#key-label")).to_have_class(re.compile("wanted"))
    page.fill("#api-key", KEY)
    page.press("#api-key", "Tab")  # `change`: the page stores the key and asks again
    expect(page.locator("#model")).to_have_text("stories260K")
    assert page.evaluate("sessionStorage.getItem('aioserve.apiKey')") == KEY
    expect(page.locator("#mode")).to_be_visible()  # completion mode before anything was sent

    before = keyed_server.info()["stats"]
    page.evaluate(SAMPLE_PAINTS)
    send(page, "Once upon a time", max_tokens=480, temperature=0)
    # Several distinct lengths, paint by paint: the text grows, not all at once.
    page.wait_for_function("() => new Set(window.__lengths.filter(n => n > 0)).size >= 6")
    expect(page.locator(".turn.reply.streaming")).to_have_count(1)
    # The reply reads as the whole text: the prompt, then its continuation
    # (stories260K goes on with ", there was..."), never a bare ", ".
    assert page.locator(".turn.reply").text_content().startswith("Once upon a time")
    assert page.locator(".turn.reply .text").text_content().startswith(",")
    assert keyed_server.info()["running"] == 1
    shot = Path(os.environ.get("AIOSERVE_SCREENSHOT") or tmp_path / "chat-page.png")
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    page.click("#stop")
    expect(page.locator(".turn.reply .note")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()

    def aborted() -> bool:
        info = keyed_server.info()
        return info["running"] == 0 and info["stats"]["aborted"] == before["aborted"] + 1

    wait_until(aborted, timeout=5)
    after = keyed_server.info()["stats"]
    assert after["finished"] == before["finished"], "the request ran to its end instead of being aborted"
    assert after["generated_tokens"] - before["generated_tokens"] < 480

    lengths = page.evaluate("window.__lengths")
    assert lengths == sorted(lengths), "the reply only ever grows"
    final = len(page.locator(".turn.reply .text").text_content())
    assert 0 < final and lengths[-1] == final
    time.sleep(0.3)
    assert len(page.locator(".turn.reply .text").text_content()) == final, "text kept coming after Stop"
    assert STATS.match(page.locator("#stats").text_content())
    # Completion mode was known up front: no chat request, so no 400 for one.
    assert not [url for url, _ in responses if "/v1/chat/completions" in url], responses
    assert not [(url, status) for url, status in responses if status == 400], responses


def test_chat_turns_render_as_text(page: Page, chat_server: RunningServer) -> None:
    """A model with a chat template: the page keeps the conversation, its
    streamed replies equal the API's, and markup in the text stays text."""
    client = openai.OpenAI(base_url=chat_server.v1, api_key="unused", max_retries=0)
    page.goto(chat_server.url)
    expect(page.locator("#model")).to_have_text("tiny-chat")

    messages: list[dict[str, str]] = []
    for prompt in ('<img src=x onerror="window.__pwned=1"><b>bold</b>', "and then?"):
        send(page, prompt, max_tokens=8, temperature=0)
        expect(page.locator("#send")).to_be_enabled()
        messages.append({"role": "user", "content": prompt})
        expected = client.chat.completions.create(
            model="tiny-chat", messages=messages, max_tokens=8, temperature=0
        ).choices[0].message.content
        assert page.locator(".turn.user").last.text_content() == prompt
        assert page.locator(".turn.reply .text").last.text_content() == expected
        messages.append({"role": "assistant", "content": expected})

    expect(page.locator("#mode")).to_be_hidden()
    assert page.locator("#transcript img, #transcript b").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert STATS.match(page.locator("#stats").text_content())


def test_stats_after_a_failure_and_after_one_token(page: Page, chat_server: RunningServer) -> None:
    """A request refused before its first token leaves no "waiting for the
    first token" behind; one token reads "1 token"."""
    page.goto(chat_server.url)
    expect(page.locator("#model")).to_have_text("tiny-chat")
    send(page, "hello", max_tokens=100_000, temperature=0)  # past the context: a 400
    expect(page.locator(".turn.reply .note.error")).to_have_count(1)
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stats")).to_have_text("no tokens")

    send(page, "hello", max_tokens=1, temperature=0)
    expect(page.locator(".turn.reply")).to_have_count(2)
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stats")).to_have_text(re.compile(r"^1 token · – tokens/s · time to first token \d+ ms$"))
    expect(page.locator("#mode")).to_be_hidden()


def test_an_attached_image_goes_with_the_prompt(page: Page, tmp_path: Path) -> None:
    """A vision-language model: the page offers to attach images (the file
    picker; dropping works alike), shows them in the user's turn, sends them
    as data URLs in image_url parts, and the reply equals the API's for the
    same image and text; the next turn keeps the image in the history."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from image_fixtures import data_url, image_bytes, image_part
    from vision_checkpoints import write_qwen2_5_vl

    checkpoint = write_qwen2_5_vl(tmp_path / "qwen-vl")
    picture = tmp_path / "picture.png"
    picture.write_bytes(image_bytes(60, 90, 1))
    server = start_server(checkpoint, "--dtype", "float32", "--served-model-name", "vl")
    try:
        page.goto(server.url)
        expect(page.locator("#model")).to_have_text("vl")
        expect(page.locator("#attach")).to_be_visible()
        page.set_input_files("#image-file", str(picture))
        expect(page.locator("#attachments img")).to_have_count(1)
        send(page, "What is this?", max_tokens=8, temperature=0)
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#attachments")).to_be_hidden()
        assert page.locator(".turn.user img").count() == 1
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": [image_part(data_url(picture.read_bytes())),
                                                 {"type": "text", "text": "What is this?"}]}]
        expected = client.chat.completions.create(model="vl", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                  temperature=0).choices[0].message.content
        assert page.locator(".turn.reply .text").last.text_content() == expected
        send(page, "and?", max_tokens=8, temperature=0)
        expect(page.locator("#send")).to_be_enabled()
        messages += [{"role": "assistant", "content": expected}, {"role": "user", "content": "and?"}]
        again = client.chat.completions.create(model="vl", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                               temperature=0).choices[0].message.content
        assert page.locator(".turn.reply .text").last.text_content() == again
    finally:
        server.stop()
