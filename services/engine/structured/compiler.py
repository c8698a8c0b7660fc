"""``StructuredOutputsParams`` -> a compiled xgrammar grammar, cached per spec.

Thread-safe: the engine server compiles on a thread pool before a request reaches the step
loop (so a slow schema delays only its own request), and the engine thread looks the result up
when the request is added (the offline ``LLM`` compiles there, synchronously). A spec the
compiler refuses raises ``BadRequest`` naming ``structured_outputs``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.protocol.structured_outputs import StructuredOutputsParams
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512  # compiled grammars kept (most are a few hundred KB at most)
_COMPILE_THREADS = 4  # concurrent compiles of different specs (xgrammar releases the GIL)
# A spec that takes longer is refused (a 400): it would hold a compile thread for that long for
# every client that sends it. Measured: a 40-object, 600-property schema compiles in ~2 s.
COMPILE_TIMEOUT_S = 30.0
_PARAM = "structured_outputs"


class GrammarCompiler:
    """One per engine: the tokenizer's index (built on first use) and the compile cache."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size  # the LM head's rows: padding rows past the tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    async def compile_async(self, spec: StructuredOutputsParams) -> None:
        """Compiles ``spec`` into the cache on a compile thread (the engine server's path, so
        the step loop and the event loop never wait for a compile)."""
        with self._lock:
            if spec.key() in self._cache:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compile, spec)
        try:
            await asyncio.wait_for(asyncio.shield(future), COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise BadRequest(f"{_PARAM}.{spec.kind} took more than {COMPILE_TIMEOUT_S:g} s to "
                             "compile; simplify it", _PARAM) from None

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        with self._lock:
            return spec.key() in self._cache

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache when it was compiled before)."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        start = time.perf_counter()
        try:
            compiled = _compile(compiler, spec)
        except BadRequest:
            raise
        except Exception as exc:  # noqa: BLE001 -- xgrammar raises several types on bad specs
            raise BadRequest(f"{_PARAM}.{spec.kind} cannot be compiled: {_first_line(exc)}",
                             _PARAM) from None
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind,
                     (time.perf_counter() - start) * 1000)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        start = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
        )
        logger.info("grammar tokenizer index built in %.0f ms",
                    (time.perf_counter() - start) * 1000)
        # Our own LRU holds the results; xgrammar's cache would keep a second copy.
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)


def _compile(compiler: Any, spec: StructuredOutputsParams) -> Any:
    kind = spec.kind
    if kind == "json":
        _check_schema(spec.json)
        return _compile_schema(compiler, spec.json, spec)
    if kind == "json_object":
        return _compile_schema(compiler, '{"type": "object"}', spec)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c) for c in spec.choice)
        )
    return _compile_grammar_text(compiler, spec.grammar)


# A rule defined EBNF's way (``name ::=`` at a line's start): the text is EBNF, never Lark.
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)


def _compile_grammar_text(compiler: Any, text: str) -> Any:
    """EBNF (GBNF) first, as vLLM's xgrammar backend; else Lark. An EBNF grammar that fails
    reports EBNF's error: Lark's on the same text ("parametric grammar is not supported")
    would hide where the client's mistake is."""
    try:
        return compiler.compile_grammar(text)
    except Exception as exc:  # noqa: BLE001 -- xgrammar raises several types on bad grammars
        ebnf_error = _first_line(exc)
    if _EBNF_RULE.search(text):
        raise BadRequest(f"{_PARAM}.grammar cannot be compiled as EBNF: {ebnf_error}", _PARAM)
    try:
        return compiler.compile_lark(text)
    except Exception as exc:  # noqa: BLE001
        raise BadRequest(f"{_PARAM}.grammar cannot be compiled as EBNF ({ebnf_error}) nor as "
                         f"Lark ({_first_line(exc)})", _PARAM) from None


# xgrammar 0.2.9 writes a string with maxLength/minLength as characters of [^"\\\r\n]: raw
# control characters (which JSON forbids, and json.loads refuses) and no escapes. Its own
# unbounded-string rule excludes them; the bounded one is given the same class.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _compile_schema(compiler: Any, schema: str, spec: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, **_layout(spec)))
    return compiler.compile_grammar(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _layout(spec: StructuredOutputsParams) -> dict[str, Any]:
    if spec.any_whitespace:
        return {"any_whitespace": True}
    return {"any_whitespace": False, "separators": (", ", ": ")}


def _check_schema(text: str) -> None:
    """A schema must itself be valid JSON Schema: xgrammar ignores what it does not know, so a
    misspelt type would otherwise constrain nothing."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(json.loads(text)).check_schema(json.loads(text))
    except jsonschema.SchemaError as exc:
        raise BadRequest(f"{_PARAM}.json is not a valid JSON schema: {exc.message}",
                         _PARAM) from None


# xgrammar's log prefix ("[06:41:27] /project/cpp/grammar_parser.cc:820: "): the client
# needs the message, not the library's build paths.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _first_line(exc: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(exc).strip(), count=1)
    return text.splitlines()[0][:300] if text else type(exc).__name__
