"""Text in and out: encoding and chat templates on a thread pool, incremental
detokenization, and stop-string matching.

Encoding runs on the Rust tokenizer directly (its batch calls release the
GIL and keep no per-call state, so pool threads can share it); transformers'
tokenizer is used only to render chat templates.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from jinja2 import TemplateError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from aioserve.hf_imports import HF_IMPORT_LOCK

logger = logging.getLogger(__name__)

Result = TypeVar("Result")

# Prompt tokens given to a new DecodeStream so that the first generated
# token decodes in context (e.g. keeps the space SentencePiece implies).
_DECODE_CONTEXT = 6


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: a client error (400)."""

    def __init__(self, message: str, refused_arguments: bool = False) -> None:
        super().__init__(message)
        self.refused_arguments = refused_arguments  # transformers refused the call's arguments, not the messages


def load_hf_tokenizer(path: str | Path) -> Any:
    """AutoTokenizer.from_pretrained(path), handed the folder's config.json read
    as transformers' base config class. Left to itself, AutoTokenizer loads
    the config through AutoConfig, whose import of the model's configuration
    module pulls in most of transformers' modeling stack (torch.distributed
    tensors, dynamo): ~2 s of a server's start, for the few fields it reads
    (model_type, tokenizer_class, the name). Anything unexpected there falls
    back to the plain call; tests/test_tokenizer_load.py checks both give
    the same tokenizer."""
    with HF_IMPORT_LOCK:  # the engine may read a config through transformers on another thread
        return _load_hf_tokenizer(Path(path))


def _load_hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedConfig

    if (folder / "config.json").is_file():
        config_logger = logging.getLogger("transformers.configuration_utils")
        level = config_logger.level
        try:
            # The base class reading a llama config warns that the types differ; it is meant.
            config_logger.setLevel(logging.ERROR)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = PreTrainedConfig.from_pretrained(str(folder))
            return AutoTokenizer.from_pretrained(str(folder), config=config)
        except Exception as exc:  # noqa: BLE001 - the plain call below decides
            logger.debug("tokenizer of %s through its base config failed (%r); loading it plainly", folder, exc)
        finally:
            config_logger.setLevel(level)
    return AutoTokenizer.from_pretrained(str(folder))


class Tokenizer:
    def __init__(self, path: str | Path, chat_template: str | None = None, workers: int = 4) -> None:
        self.hf = load_hf_tokenizer(path)
        self.rust: RustTokenizer = self.hf.backend_tokenizer
        if chat_template is not None:
            self.hf.chat_template = Path(chat_template).read_text()
        self.vocab_size = len(self.hf)
        self._token_texts: dict[int, str] = {}
        self._anchor = self.encode("a", add_special_tokens=False)[-1]
        self.max_token_chars = max(len(piece) for piece in self.rust.get_vocab(with_added_tokens=True))
        self._pool = started_pool(workers)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    # -- synchronous ------------------------------------------------------------

    # The *_batch calls, on one item: unlike encode/decode they release the GIL
    # while they work, so a long prompt tokenizing on the pool cannot hold the
    # event loop (a 12 MB prompt held it 13 s through `encode`).
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, first: str, second: str, prompt: str | None = None) -> list[int]:
        """A reranker's input: `prompt` where a causal reranker writes the pair
        into one (pooling_config.pair_text: its template carries its own special
        tokens), else both texts with the tokenizer's pair template ([CLS] A
        [SEP] B [SEP] for BERT, <s> A </s></s> B </s> for XLM-R)."""
        if prompt is not None:
            return self.encode(prompt, add_special_tokens=False)
        return self.rust.encode_batch([(first, second)], add_special_tokens=True)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.rust.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def min_tokens_for_chars(self, chars: int) -> int:
        """A lower bound on the tokens a text of `chars` characters encodes
        to, without encoding it. No token covers more characters of text than
        its piece has (byte-level pieces spell bytes, SentencePiece's spell the
        characters), and no piece is longer than max_token_chars; the factor 4
        leaves room for normalizers that shrink text (NFC composes up to 3
        code points into one). Lets a prompt that cannot
        fit be refused before it is tokenized, and never one that fits."""
        return chars // (4 * self.max_token_chars)

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads mid-sentence (for logprobs listings),
        cached. Decoded after an anchor token and cut, because decoders such
        as SentencePiece's drop a leading space at the start of a text."""
        text = self._token_texts.get(token_id)
        if text is None:
            anchor_text = self.rust.decode([self._anchor], skip_special_tokens=False)
            both = self.rust.decode([self._anchor, token_id], skip_special_tokens=False)
            if both.startswith(anchor_text):
                text = both[len(anchor_text) :]
            else:
                text = self.rust.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.has_chat_template:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; start the server with --chat-template FILE"
            )
        try:
            return self.hf.apply_chat_template(
                [normalize_message(m) for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TemplateError as exc:  # the template refusing the messages (raise_exception), or a bad template
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
        except ValueError as exc:  # transformers refusing the arguments (continue_final_message without one)
            raise ChatTemplateError(f"cannot render these messages: {exc}", refused_arguments=True) from exc
        # Anything else (a TypeError inside the template code) is the server's
        # fault, not the client's: it goes up and becomes this request's 500.

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        rewrite: Callable[[str], str] | None = None, **kwargs: Any,
    ) -> list[int]:
        """The rendered chat's ids; `rewrite` changes the rendered text first
        (a vision family that writes each image's tokens into it)."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        if rewrite is not None:
            text = rewrite(text)
        # The template writes BOS itself; encoding with special tokens would double it.
        return self.encode(text, add_special_tokens=False)

    # -- on the thread pool -------------------------------------------------------

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, text, add_special_tokens)

    async def encode_pair_async(self, first: str, second: str, prompt: str | None = None) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode_pair, first, second, prompt)

    async def encode_chat_async(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self.encode_chat(messages, **kwargs))

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.decode, ids, skip_special_tokens)

    async def run_async(self, work: Callable[..., Result], *args: Any) -> Result:
        """Other vocabulary work (compiling a grammar) on the same pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def started_pool(workers: int, name: str = "aioserve-tokenizer") -> ThreadPoolExecutor:
    """A pool whose threads all run already. ThreadPoolExecutor starts a thread
    at submit time and waits for it to run, which takes the GIL: while another
    worker holds it (a chat template on a huge conversation), `submit` would
    stall the event loop."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
    barrier = threading.Barrier(workers)
    for _ in range(workers):
        pool.submit(barrier.wait)  # each waits for the others: one thread per task
    return pool


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """List-of-parts content becomes one string (templates expect strings),
    unless it holds an image: a vision-language model's template walks the
    parts and writes its image placeholder at each `{"type": "image"}`."""
    content = message.get("content")
    if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") == "image" for part in content):
        return message
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        message = {**message, "content": "\n".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return message


class IncrementalDetokenizer:
    """Text for each new token, correct across multi-byte UTF-8 split over
    byte-fallback tokens (held back until the character is complete)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._rust = tokenizer.rust
        self._context = prompt_ids[-_DECODE_CONTEXT:]
        self._skip_special_tokens = skip_special_tokens
        self._stream: DecodeStream | None = None

    def step(self, token_id: int) -> str:
        if self._stream is None:
            # Made at the first token, not before: the prompt's ids are checked
            # by the scheduler when it accepts the request, after the stream exists.
            self._stream = DecodeStream(ids=self._context, skip_special_tokens=self._skip_special_tokens)
        try:
            return self._stream.step(self._rust, token_id) or ""
        except Exception:  # ids beyond the tokenizer's vocabulary (padded embeddings)
            return ""


class StopStringMatcher:
    """Finds stop strings in streamed text, also across token boundaries, by
    holding back the last len(longest stop) - 1 characters until they cannot
    begin a match."""

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str, active: bool = True) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was reached.
        While not `active` (min_tokens not yet generated) no stop string
        counts: the text passes, and none held back can match later."""
        if not self.stops:
            return text, False
        if not active:
            emitted, self._pending = self._pending + text, ""
            return emitted, False
        self._pending += text
        hits = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        if hits:
            index, stop = min(hits)
            self.matched = stop
            emitted = self._pending[: index + (len(stop) if self.include_stop else 0)]
            self._pending = ""
            return emitted, True
        cut = max(0, len(self._pending) - self._hold)
        emitted, self._pending = self._pending[:cut], self._pending[cut:]
        return emitted, False

    def flush(self) -> str:
        """What is held back, once the request ends without a stop string."""
        emitted, self._pending = self._pending, ""
        return emitted
