"""Image intake for vision-language models (aioserve/images and its server
wiring), without a model: sources (data URLs, guarded http fetches, local
files), decoding with its guards, the checkpoint's image processor,
placeholder expansion into PromptImages, and the routes in process with a
scheduler stand-in that records what it is handed. Every bad image is a
400 naming its part, within its limit, and never holds the event loop."""

from __future__ import annotations

import asyncio
import http.server
import io
import ipaddress
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from image_fixtures import (
    IMAGE_MARKER, animated_gif, build_vl_intake_folder, data_url, gif_bomb, image_bytes, image_part,
    png_data_url, png_header_only,
)

from aioserve.config import EngineConfig, ServerArgs, images_per_prompt
from aioserve.image_inputs import content_key, mrope_positions
from aioserve.images import ImageError, ImageIntake, MediaSettings, load_image_intake
from aioserve.images.addresses import is_public
from aioserve.images.decode import decode_image
from aioserve.images.prompt import PlaceholderMismatch, expand_images, placeholder_offsets
from aioserve.images.sources import read_source
from aioserve.scheduler.request import Request, RequestEvent
from aioserve.tokenizer import Tokenizer, normalize_message

MIB = 1 << 20


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_intake_folder(tmp_path_factory.mktemp("vl-intake"))


@pytest.fixture(scope="module")
def tokenizer(vl_folder: Path) -> Iterator[Tokenizer]:
    tokenizer = Tokenizer(vl_folder, workers=2)
    yield tokenizer
    tokenizer.shutdown()


def make_intake(folder: Path, tokenizer: Tokenizer, **settings: Any) -> ImageIntake:
    intake = load_image_intake(
        folder, MediaSettings(**settings), tokenizer.run_async, lambda: ThreadPoolExecutor(4),
        tokenizer.rust.token_to_id,
    )
    assert intake is not None
    return intake


@pytest.fixture(scope="module")
def intake(vl_folder: Path, tokenizer: Tokenizer) -> Iterator[ImageIntake]:
    intake = make_intake(vl_folder, tokenizer, allow_private_urls=True, fetch_timeout=1.0)
    yield intake
    intake.shutdown()


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


class ImageSite(http.server.BaseHTTPRequestHandler):
    """The local server the URL cases fetch from (see `site`)."""

    protocol_version = "HTTP/1.1"
    routes: dict[str, Callable[[ImageSite], None]] = {}
    stop = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        route = self.routes.get(self.path)
        if route is None:
            self.send_error(404)
            return
        try:
            route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetch was aborted: what these tests want

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, body: bytes, content_type: str = "image/png", status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """http://127.0.0.1:PORT serving: /cat.png, /page.html (HTML), /slow
    (answers after 5 s), /trickle (a byte every 0.2 s), /to-cat (a redirect),
    /to-private (a redirect to 127.0.0.2), /loop (redirects to itself),
    /huge (declares 100 MiB), /endless (no length, streams on)."""
    server = QuietServer(("127.0.0.1", 0), ImageSite)
    port = server.server_address[1]
    cat = image_bytes(64, 48, seed=1)

    def slow(handler: ImageSite) -> None:
        ImageSite.stop.wait(5)
        handler.reply(cat)

    def trickle(handler: ImageSite) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", str(len(cat)))
        handler.end_headers()
        for byte in cat:
            if ImageSite.stop.wait(0.2):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()

    def endless(handler: ImageSite) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Connection", "close")
        handler.end_headers()
        while not ImageSite.stop.is_set():
            handler.wfile.write(b"\0" * 65536)

    def huge(handler: ImageSite) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", str(100 * MIB))
        handler.end_headers()
        handler.wfile.write(cat)

    ImageSite.routes = {
        "/cat.png": lambda h: h.reply(cat),
        "/page.html": lambda h: h.reply(b"<!doctype html><html><body>not an image</body></html>", "text/html"),
        "/slow": slow,
        "/trickle": trickle,
        "/to-cat": lambda h: h.redirect("/cat.png"),
        "/to-private": lambda h: h.redirect(f"http://127.0.0.2:{port}/cat.png"),
        "/loop": lambda h: h.redirect("/loop"),
        "/huge": huge,
        "/endless": endless,
    }
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    ImageSite.stop.set()
    server.shutdown()
    server.server_close()


def image_error(call: Callable[[], Any]) -> ImageError:
    with pytest.raises(ImageError) as info:
        call()
    return info.value


# -- flags ---------------------------------------------------------------------------------------


def test_limit_mm_per_prompt_reads_vllms_spellings() -> None:
    from aioserve.cli import parse_serve_args, serve_argv

    assert images_per_prompt(None) == 16
    for flag, count in (('{"image": 4}', 4), ("image=3,video=0", 3), ('{"image": {"count": 2, "width": 512}}', 2)):
        args = parse_serve_args(["--limit-mm-per-prompt", flag])
        assert images_per_prompt(args.limit_mm_per_prompt) == count
        assert parse_serve_args(serve_argv(args)) == args  # --dp replicas get the same flags
    for bad in ('{"video": 1}', '{"image": -1}', '{"sound": 1}', "image=x"):
        with pytest.raises(SystemExit):
            parse_serve_args(["--limit-mm-per-prompt", bad])
    args = parse_serve_args(["--allowed-local-media-path", "/srv/images", "--media-fetch-timeout", "2",
                             "--max-image-bytes", "1MiB", "--allow-private-media-urls"])
    settings = MediaSettings.from_args(args)
    assert (settings.allowed_local_path, settings.fetch_timeout, settings.max_image_bytes) == ("/srv/images", 2.0, MIB)
    assert settings.allow_private_urls and not MediaSettings.from_args(ServerArgs(EngineConfig())).allow_private_urls


# -- sources -------------------------------------------------------------------------------------


def test_data_urls() -> None:
    settings = MediaSettings(max_image_bytes=MIB)
    png = image_bytes(8, 8)
    assert read_source(data_url(png), settings).data == png
    assert read_source(data_url(png).rstrip("="), settings).data == png  # padding left off
    wrapped = data_url(png)
    assert read_source(wrapped[:60] + "\n" + wrapped[60:], settings).data == png
    assert "not an image" in image_error(lambda: read_source("data:text/plain;base64,aGk=", settings)).message
    assert "base64" in image_error(lambda: read_source("data:image/png,rawbytes", settings)).message
    assert "malformed" in image_error(lambda: read_source("data:image/png;base64,@@@@", settings)).message
    assert "comma" in image_error(lambda: read_source("data:image/png;base64", settings)).message
    big = data_url(b"\0" * (MIB + 16))
    assert "limit" in image_error(lambda: read_source(big, settings)).message
    assert "scheme 'ftp'" in image_error(lambda: read_source("ftp://example.com/a.png", settings)).message


def test_local_files_only_under_the_allowed_path(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(image_bytes(8, 8))
    (tmp_path / "secret.png").write_bytes(b"secret")
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "inside.png").symlink_to(root / "cat.png")
    os.mkfifo(root / "fifo.png")
    allowed = MediaSettings(allowed_local_path=str(root), max_image_bytes=MIB)

    assert read_source(f"file://{root}/cat.png", allowed).data == image_bytes(8, 8)
    assert read_source(str(root / "cat.png"), allowed).data == image_bytes(8, 8)
    assert read_source(str(root / "inside.png"), allowed).data == image_bytes(8, 8)  # a link that stays inside
    refused = {
        f"file://{root}/cat.png": MediaSettings(),  # no --allowed-local-media-path
        f"file://{root}/../secret.png": allowed,
        str(root / "escape.png"): allowed,  # a symlink out
        "cat.png": allowed,  # relative
        f"file://otherhost{root}/cat.png": allowed,
        str(root / "missing.png"): allowed,
    }
    for url, settings in refused.items():
        assert image_error(lambda: read_source(url, settings)).message, url
    started = time.monotonic()
    assert "regular file" in image_error(lambda: read_source(str(root / "fifo.png"), allowed)).message
    assert time.monotonic() - started < 1  # a FIFO with no writer must not block the thread
    small = MediaSettings(allowed_local_path=str(root), max_image_bytes=16)
    assert "limit" in image_error(lambda: read_source(str(root / "cat.png"), small)).message


def test_public_addresses() -> None:
    for text in ("8.8.8.8", "2001:4860:4860::8888", "1.1.1.1"):
        assert is_public(ipaddress.ip_address(text)), text
    for text in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
                 "224.0.0.1", "255.255.255.255", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
                 "64:ff9b::7f00:1", "2002:7f00:1::1", "::"):
        assert not is_public(ipaddress.ip_address(text)), text


def test_fetch_over_http(site: str) -> None:
    allowed = MediaSettings(allow_private_urls=True, fetch_timeout=2.0, max_image_bytes=MIB)
    cat = read_source(f"{site}/cat.png", allowed)
    assert cat.data == image_bytes(64, 48, seed=1) and cat.content_type == "image/png"
    assert read_source(f"{site}/to-cat", allowed).data == cat.data
    port = site.rsplit(":", 1)[1]
    assert read_source(f"http://localhost:{port}/cat.png", allowed).data == cat.data  # ::1 refused, 127.0.0.1 tried
    page = read_source(f"{site}/page.html", allowed)
    decode_error = image_error(lambda: decode_image(page.data, MIB, 10**6, page.content_type))
    assert "not an image" in decode_error.message and "text/html" in decode_error.message
    assert "404" in image_error(lambda: read_source(f"{site}/missing.png", allowed)).message
    assert "redirected more than 3" in image_error(lambda: read_source(f"{site}/loop", allowed)).message
    for path in ("/huge", "/endless"):
        started = time.monotonic()
        assert "limit" in image_error(lambda: read_source(f"{site}{path}", allowed)).message
        assert time.monotonic() - started < 2


def test_private_addresses_are_refused_on_every_hop(site: str, monkeypatch: pytest.MonkeyPatch) -> None:
    strict = MediaSettings(fetch_timeout=2.0)
    port = site.rsplit(":", 1)[1]
    for url in (f"{site}/cat.png", f"http://localhost:{port}/cat.png", f"http://[::ffff:127.0.0.1]:{port}/cat.png",
                "http://169.254.169.254/latest/meta-data", "http://10.0.0.1/cat.png"):
        started = time.monotonic()
        assert "private, loopback or link-local" in image_error(lambda: read_source(url, strict)).message, url
        assert time.monotonic() - started < 1  # refused before connecting
    # The first hop public (127.0.0.1 counted so here), its redirect to 127.0.0.2 is not.
    monkeypatch.setattr("aioserve.images.http_fetch.is_public", lambda address: str(address) == "127.0.0.1")
    assert read_source(f"{site}/to-cat", strict).data == image_bytes(64, 48, seed=1)
    error = image_error(lambda: read_source(f"{site}/to-private", strict))
    assert "127.0.0.2" in error.message and "private" in error.message


def test_fetch_deadline_holds_for_slow_and_trickling_servers(site: str) -> None:
    settings = MediaSettings(allow_private_urls=True, fetch_timeout=0.5)
    for path in ("/slow", "/trickle"):
        started = time.monotonic()
        error = image_error(lambda: read_source(f"{site}{path}", settings))
        assert "longer than 0.5 s" in error.message, error.message
        assert time.monotonic() - started < 1.5, path


# -- decoding ------------------------------------------------------------------------------------


def test_decode_guards() -> None:
    cap = 50_000_000
    image = decode_image(image_bytes(40, 30, fmt="JPEG"), MIB, cap)
    assert (image.size, image.mode) == ((40, 30), "RGB")
    cases = {
        "truncated": (image_bytes(64, 64)[:200], "truncated"),
        "html": (b"<html><body>hello</body></html>", "not an image"),
        "empty": (b"", "empty"),
        "20000x20000": (png_header_only(20_000, 20_000), "pixels"),
        "gif bomb": (gif_bomb(), "pixels"),
        "over the pixel cap": (png_header_only(8000, 8000), "8000x8000"),
        "tiff": (image_bytes(8, 8, fmt="TIFF"), "not an image"),
    }
    for name, (data, said) in cases.items():
        started = time.monotonic()
        assert said in image_error(lambda: decode_image(data, MIB, cap)).message, name
        assert time.monotonic() - started < 0.5, name  # refused from the header: nothing decoded
    assert "limit" in image_error(lambda: decode_image(image_bytes(64, 64), 100, cap)).message
    first = decode_image(animated_gif([(255, 0, 0), (0, 255, 0)]), MIB, cap)
    assert first.getpixel((5, 5)) == (255, 0, 0)  # an animation's first frame
    clear = decode_image(image_bytes(8, 8, mode="RGBA"), MIB, cap)
    assert clear.mode == "RGB"


# -- processing and prompts --------------------------------------------------------------------


def test_processing_gives_each_image_its_own_tensors(intake: ImageIntake) -> None:
    from PIL import Image

    wide = intake.prepare(read_source(png_data_url(100, 60, seed=2), intake.settings))
    t, h, w = (int(n) for n in wide.tensors["image_grid_thw"][0])
    assert wide.tensors["pixel_values"].shape[0] == t * h * w
    assert wide.num_tokens == t * h * w // 4 and wide.grid == (t, h // 2, w // 2)
    assert 4 <= wide.num_tokens <= 64  # the preprocessor's pixel budget
    assert wide.key == content_key(wide.tensors)
    same = intake.prepare(read_source(png_data_url(100, 60, seed=2), intake.settings))
    other = intake.prepare(read_source(png_data_url(100, 60, seed=3), intake.settings))
    assert same.key == wide.key and other.key != wide.key
    reference = intake.processor.hf(images=[Image.open(io.BytesIO(image_bytes(100, 60, seed=2)))],
                                    return_tensors="pt")
    assert torch.equal(reference["pixel_values"], wide.tensors["pixel_values"])
    thin = read_source(png_data_url(1000, 4), intake.settings)
    assert "aspect ratio" in image_error(lambda: intake.prepare(thin)).message


def test_chat_template_places_images_and_expansion_fills_them(intake: ImageIntake, tokenizer: Tokenizer) -> None:
    images = [intake.prepare(read_source(png_data_url(56 * k, 56, seed=k), intake.settings)) for k in (1, 2)]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what differs between"}, {"type": "image"}, {"type": "text", "text": "and"},
        {"type": "image"},
    ]}]
    text = tokenizer.render_chat(messages)
    assert text.count(IMAGE_MARKER) == 2 and "what differs between" + IMAGE_MARKER + "and" in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    pad = intake.family.tokens.pad_id
    assert pad == tokenizer.rust.token_to_id("<|image_pad|>") and ids.count(pad) == 2

    expanded, prompt_images = expand_images(ids, images, intake.family)
    assert len(expanded) == len(ids) - 2 + sum(image.num_tokens for image in images)
    offsets = placeholder_offsets(ids, pad)
    assert [span.offset for span in prompt_images.spans] == [offsets[0], offsets[1] - 1 + images[0].num_tokens]
    for span in prompt_images.spans:
        assert expanded[span.offset - 1] == tokenizer.rust.token_to_id("<|vision_start|>")
        assert expanded[span.offset:span.end] == [pad] * span.image.num_tokens
        assert expanded[span.end] == tokenizer.rust.token_to_id("<|vision_end|>")
    assert prompt_images.num_tokens == expanded.count(pad)
    positions, delta = mrope_positions(len(expanded), prompt_images.spans)
    assert prompt_images.mrope is not None and torch.equal(prompt_images.mrope, positions)
    assert prompt_images.rope_delta == delta
    cache_ids = prompt_images.cache_ids(expanded)
    assert cache_ids[prompt_images.spans[0].offset] != cache_ids[prompt_images.spans[1].offset]

    with pytest.raises(PlaceholderMismatch):
        expand_images(ids, images[:1], intake.family)
    with pytest.raises(PlaceholderMismatch):
        expand_images(ids + [pad], images, intake.family)


def test_text_only_messages_render_as_before(tokenizer: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert normalize_message(parts[0]) == {"role": "user", "content": "a\nb"}
    assert tokenizer.render_chat(parts) == tokenizer.render_chat([{"role": "user", "content": "a\nb"}])


def test_a_text_model_folder_has_no_intake(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert load_image_intake(tmp_path, MediaSettings(), tokenizer.run_async, ThreadPoolExecutor,
                             tokenizer.rust.token_to_id) is None


def test_a_vision_folder_without_its_processor_serves_text_only(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Copied without preprocessor_config.json: text still serves (logged), images are refused."""
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2_5_VLForConditionalGeneration"]}')
    assert load_image_intake(tmp_path, MediaSettings(), tokenizer.run_async, ThreadPoolExecutor,
                             tokenizer.rust.token_to_id) is None


# -- the async intake: every image at once, off the loop -----------------------------------------


async def _max_loop_gap(work: Any) -> tuple[Any, float]:
    """`work`'s result (or exception), and the longest the loop went
    without running a 10 ms ticker meanwhile."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        result: Any = await work
    except Exception as exc:  # noqa: BLE001 - handed back to the test
        result = exc
    done.set()
    await ticking
    return result, max(gaps, default=0.0)


def test_load_reports_the_failing_image_and_never_blocks_the_loop(intake: ImageIntake, site: str) -> None:
    good = png_data_url(64, 64)
    loaded, gap = run(_max_loop_gap(intake.load([good, f"{site}/cat.png", good])))
    assert len(loaded) == 3 and loaded[0].key == loaded[2].key != loaded[1].key
    assert gap < 0.25
    for urls, index, said in (
        ([good, f"{site}/page.html"], 1, "not an image"),
        ([data_url(png_header_only(20_000, 20_000)), good], 0, "pixels"),
        ([good, good, f"{site}/slow"], 2, "longer than 1 s"),
    ):
        started = time.monotonic()
        error, gap = run(_max_loop_gap(intake.load(urls)))
        assert isinstance(error, ImageError) and error.index == index and said in error.message, error
        assert time.monotonic() - started < 3
        assert gap < 0.25, f"the loop stalled {gap:.2f} s"


# -- the routes, in process, with a scheduler stand-in --------------------------------------------


class RecordingScheduler:
    """Keeps each request it is handed and ends it at once with one token."""

    num_waiting = 0
    serves_adapters = False

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def submit_all(self, requests: list[Request]) -> None:
        self.requests += requests
        loop = asyncio.get_running_loop()
        for request in requests:
            event = RequestEvent(token_id=5, logprob=-1.0, finish_reason="length",
                                 num_prompt_tokens=len(request.prompt_ids), num_cached_tokens=0)
            loop.call_soon(request.sink, event)

    def abort(self, rid: str, reason: str = "abort") -> None:
        pass

    def adapter(self, name: str) -> None:
        return None


def app_for(tokenizer: Tokenizer, images: ImageIntake | None) -> tuple[Any, RecordingScheduler]:
    from aioserve.server.context import ServingContext
    from aioserve.server.endpoints.app import create_app

    scheduler = RecordingScheduler()
    args = ServerArgs(EngineConfig(model="tiny-vl"))
    ctx = ServingContext(args, scheduler, tokenizer, 1024, tokenizer.vocab_size, images=images)
    return create_app(ctx), scheduler


async def _post(app: Any, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body, timeout=30)


def post(app: Any, path: str, body: dict) -> httpx.Response:
    return run(_post(app, path, body))


def chat_body(*content: dict, **fields: Any) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": list(content)}],
            "max_tokens": 1, **fields}


def assert_400(response: httpx.Response, param: str, *said: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for words in said:
        assert words in error["message"], error
    return error


def test_chat_with_images_reaches_the_scheduler(intake: ImageIntake, tokenizer: Tokenizer) -> None:
    app, scheduler = app_for(tokenizer, intake)
    text = {"type": "text", "text": "describe"}
    response = post(app, "/v1/chat/completions", chat_body(text, image_part(png_data_url(80, 40)),
                                                           {"type": "image_url", "image_url": png_data_url(40, 80)}))
    assert response.status_code == 200, response.text
    (request,) = scheduler.requests
    images = request.images
    assert images is not None and len(images.spans) == 2 and images.mrope is not None
    assert request.prompt_ids.count(intake.pad_id) == images.num_tokens
    assert response.json()["usage"]["prompt_tokens"] == len(request.prompt_ids)
    counted = post(app, "/tokenize", {"messages": chat_body(text, image_part(png_data_url(80, 40)),
                                                           image_part(png_data_url(40, 80)))["messages"]})
    assert counted.json()["count"] == len(request.prompt_ids)  # /tokenize counts the image tokens as chat does

    # An image's megabytes are no text for the template's length bound (4 contexts of text at most).
    large = post(app, "/v1/chat/completions", chat_body(text, image_part(data_url(image_bytes(400, 400, seed=4)))))
    assert large.status_code == 200, large.text

    # text only, on a vision-language model: no images, the prompt as a text model's
    plain = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert plain.status_code == 200 and scheduler.requests[-1].images is None


def test_bad_images_are_400s_naming_their_part(
    intake: ImageIntake, tokenizer: Tokenizer, site: str, vl_folder: Path
) -> None:
    app, scheduler = app_for(tokenizer, intake)
    text = {"type": "text", "text": "look"}
    cases = [
        (image_part(f"{site}/page.html"), "not an image"),
        (image_part(data_url(image_bytes(64, 64)[:300])), "truncated"),
        (image_part(data_url(png_header_only(20_000, 20_000))), "pixels"),
        (image_part(data_url(gif_bomb())), "pixels"),
        (image_part(f"{site}/slow"), "longer than"),
        (image_part("file:///etc/passwd"), "--allowed-local-media-path"),
    ]
    for part, said in cases:
        response = post(app, "/v1/chat/completions", chat_body(text, part))
        error = assert_400(response, "messages.1.content.1.image_url", said)
        assert error["code"] == "invalid_image"
    strict = make_intake(vl_folder, tokenizer, max_images=2)
    try:
        strict_app, _ = app_for(tokenizer, strict)
        many = [image_part(png_data_url(56, 56, seed=k)) for k in range(3)]
        assert_400(post(strict_app, "/v1/chat/completions", chat_body(*many)), "messages.1.content.2.image_url",
                   "more than this server's limit of 2")
        private = post(strict_app, "/v1/chat/completions", chat_body(image_part(f"{site}/cat.png")))
        assert_400(private, "messages.1.content.0.image_url", "private")
    finally:
        strict.shutdown()
    # images in a system message; text that spells the image token
    system_image = {"messages": [{"role": "system", "content": [image_part(png_data_url(8, 8))]}]}
    assert_400(post(app, "/v1/chat/completions", system_image), "messages.0", "user messages only")
    spelled = chat_body({"type": "text", "text": f"see {IMAGE_MARKER}"}, image_part(png_data_url(56, 56)))
    assert_400(post(app, "/v1/chat/completions", spelled), "messages", "2 image placeholders for 1 images")
    raw = post(app, "/v1/completions", {"prompt": f"a {IMAGE_MARKER} b", "max_tokens": 1})
    assert_400(raw, "prompt", "image tokens")
    assert not scheduler.requests


def test_responses_and_generate_take_images(intake: ImageIntake, tokenizer: Tokenizer) -> None:
    app, scheduler = app_for(tokenizer, intake)
    url = png_data_url(56, 112)
    response = post(app, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": url}]}]})
    assert response.status_code == 200, response.text
    assert scheduler.requests[-1].images is not None and len(scheduler.requests[-1].images.spans) == 1
    bad = post(app, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": data_url(b"nope")}]}]})
    assert_400(bad, "input.0.content.1.image_url", "not an image")
    no_url = post(app, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    assert_400(no_url, "input.0.content.0.image_url", "file_id")

    # SGLang's /generate: the text holds the marker once per image
    generated = post(app, "/generate", {"text": f"describe {IMAGE_MARKER} and {IMAGE_MARKER}",
                                        "image_data": [url, png_data_url(112, 56)],
                                        "sampling_params": {"max_new_tokens": 1}})
    assert generated.status_code == 200, generated.text
    assert len(scheduler.requests[-1].images.spans) == 2
    batch = post(app, "/generate", {"text": [f"a {IMAGE_MARKER}", "no image"], "image_data": [url, None],
                                    "sampling_params": {"max_new_tokens": 1}})
    assert batch.status_code == 200, batch.text
    assert scheduler.requests[-2].images is not None and scheduler.requests[-1].images is None
    assert_400(post(app, "/generate", {"text": "no marker", "image_data": url}), "text", "once per image")
    assert_400(post(app, "/generate", {"text": IMAGE_MARKER, "image_data": [data_url(b"x")]}), "image_data.0",
               "not an image")
    assert_400(post(app, "/generate", {"text": ["a", "b"], "image_data": [url]}), "image_data", "one per prompt")


def test_a_text_model_refuses_images_by_name(tokenizer: Tokenizer) -> None:
    app, scheduler = app_for(tokenizer, None)
    image = image_part(png_data_url(8, 8))
    chat = post(app, "/v1/chat/completions", chat_body({"type": "text", "text": "x"}, image))
    assert_400(chat, "messages.1.content", "text only", "image_url", "not a vision-language model")
    tokenize = post(app, "/tokenize", {"messages": chat_body(image)["messages"]})
    assert_400(tokenize, "messages.1.content", "text only")
    responses = post(app, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]})
    assert_400(responses, "input.0.content.0", "text only")
    generate = post(app, "/generate", {"text": "x", "image_data": "https://example.com/cat.png"})
    assert_400(generate, "image_data", "text only")
    empty = {"text": "x", "image_data": [], "sampling_params": {"max_new_tokens": 1}}
    assert post(app, "/generate", empty).status_code == 200  # an empty image_data asks for nothing
    assert_400(post(app, "/v1/chat/completions", {**chat_body({"type": "text", "text": "x"}), "image_data": ["a"]}),
               "image_data", "image_url content parts")
    # a model that takes text only reads its image token as text: no check of image tokens
    assert post(app, "/v1/completions", {"prompt": IMAGE_MARKER, "max_tokens": 1}).status_code == 200
    assert len(scheduler.requests) == 2 and all(r.images is None for r in scheduler.requests)
