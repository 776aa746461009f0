"""Compiling StructuredOutputParams into grammars, off the event loop and cached.

The vocabulary view xgrammar needs (every token's bytes) is built once per
tokenizer, on first use (about 2 s for Qwen3's 151k tokens). Compilation
runs on workers of its own (a burst of heavy grammars never starves
tokenization) within a budget: a grammar text past `max_chars` is refused
before compiling (a 1.2 MB EBNF compiled for 118 s, 50k choices for 56 s),
and a request whose compile outlasts `timeout_s` gets its 400 then (the
compile finishes on its worker and is cached). Compiled grammars are kept
in an LRU cache keyed by the constraint itself (the schema's canonical
JSON, the regex, ...), bounded by entries and by their bytes, so a client
that sends the same schema with every request compiles it once.

JSON is generated compact (", " and ": " separators, no free whitespace):
that is how models print JSON anyway, and a free whitespace rule lets a
weak or confused model pad forever without ever closing the object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioserve.grammar.json_strings import strict_json_schema_grammar
from aioserve.grammar.matcher import CompiledGrammar
from aioserve.sampling_params import StructuredOutputParams
from aioserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

CACHE_SIZE = 512
CACHE_BYTES = 256 << 20  # compiled grammars held (a 50k-value enum took ~130 MB)
COMPILE_WORKERS = 2


@dataclass(frozen=True)
class GrammarBudget:
    """What one constraint may cost to compile (ServerArgs' --max-grammar-chars, --grammar-compile-timeout)."""

    max_chars: int = 128 << 10
    timeout_s: float = 20.0

# xgrammar prefixes its errors with a timestamp and the C++ source line.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A constraint that does not compile; `kind` names what was wrong
    (json, regex, choice, grammar)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class GrammarCompiler:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, budget: GrammarBudget | None = None,
        cache_size: int = CACHE_SIZE, cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.budget = budget or GrammarBudget()
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # the lazy vocabulary build and the cache
        self._cache: OrderedDict[tuple[str, str], tuple[CompiledGrammar, int]] = OrderedDict()
        self.cached_bytes = 0
        self.hits = 0  # compiles the cache saved (read by the tests)
        self._workers = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="aioserve-grammar")

    def _xgrammar(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr  # here, not at the top: it takes ~1 s to import, and most servers never need it

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.hf, vocab_size=self.vocab_size)
                # Our own cache below: one entry per constraint, not per grammar text.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputParams) -> CompiledGrammar:
        """The grammar for `spec` (from the cache when it was compiled
        before); GrammarError when it does not compile."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        key = spec.key()
        grammar = CompiledGrammar(self._compile(spec, key[0]), key[0])
        if not grammar.allows_a_first_token(self.vocab_size):
            # Else every request with it would fail at its first step.
            raise GrammarError(f"the {_WHAT[key[0]]} matches no text this vocabulary can spell", key[0])
        self._keep(key, grammar)
        return grammar

    def _cached(self, spec: StructuredOutputParams) -> CompiledGrammar | None:
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is None:
                return None
            self._cache.move_to_end(key)
            self.hits += 1
            return cached[0]

    def _keep(self, key: tuple[str, str], grammar: CompiledGrammar) -> None:
        size = int(grammar.compiled.memory_size_bytes)
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = (grammar, size)
            self.cached_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes):
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped

    async def compile_async(self, spec: StructuredOutputParams) -> CompiledGrammar:
        """`compile` on the grammar workers (a cached grammar at once);
        GrammarError past the budget's time."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        work = asyncio.get_running_loop().run_in_executor(self._workers, self.compile, spec)
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.budget.timeout_s)
        except asyncio.TimeoutError:
            kind = spec.key()[0]
            raise GrammarError(
                f"compiling the {_WHAT[kind]} took longer than {self.budget.timeout_s:g} s "
                "(--grammar-compile-timeout); a simpler one compiles faster", kind,
            ) from None

    def _compile(self, spec: StructuredOutputParams, kind: str) -> xgr.CompiledGrammar:
        compiler = self._xgrammar()
        try:
            if kind == "json_object":
                # Not strict: any members, of any JSON type.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            text = self._grammar_text(spec, kind)
            if kind == "json":
                # Bounded strings rewritten to admit no raw control character (json_strings.py).
                return compiler.compile_grammar(strict_json_schema_grammar(text))
            if kind == "regex":
                return compiler.compile_regex(text)
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(f"invalid {_WHAT[kind]}: {_clean(str(exc))}", kind) from None


    def _grammar_text(self, spec: StructuredOutputParams, kind: str) -> str:
        """The text compiled for `spec`, refused past the budget's size."""
        if kind == "json":
            text = _schema_text(spec.json)
        elif kind == "regex":
            text = spec.regex or ""
        elif kind == "choice":
            text = choice_grammar(spec.choice or [])
        else:
            text = spec.grammar or ""
        if len(text) > self.budget.max_chars:
            raise GrammarError(
                f"the {_WHAT[kind]} is {len(text)} characters, more than this server compiles "
                f"({self.budget.max_chars}, --max-grammar-chars)", kind,
            )
        return text


_WHAT = {
    "json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
    "grammar": "grammar",
}


def _schema_text(schema: dict[str, Any] | bool | str | None) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"invalid JSON schema: not JSON ({exc})", "json") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("invalid JSON schema: a schema is a JSON object", "json")
    return json.dumps(schema)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of `choices` (JSON string escapes are
    also EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _clean(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else message
    return _XGRAMMAR_PREFIX.sub("", first).strip()


_compilers: "weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int, budget: GrammarBudget | None = None) -> GrammarCompiler:
    """The one compiler (and cache) of a tokenizer; masks are `vocab_size`
    (the model's) tokens wide; `budget` (the first caller's) bounds each compile."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None or compiler.vocab_size != vocab_size:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer, vocab_size, budget)
        return compiler
