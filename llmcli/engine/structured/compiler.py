"""Compiling each distinct constraint off the step loop (a thread pool), into a few independent templates."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmcli.engine.structured.grammar import GrammarError, grammar_text, load_llguidance, parser_limits
from llmcli.engine.structured.harmony_grammar import HarmonyFrame
from llmcli.engine.structured.masks import mask_threads
from llmcli.sampling_params import StructuredOutputsParams

# A request's matcher is a ``deep_copy`` of a template, and llguidance's copies share the template's lexer
# behind one lock that is held for a whole mask: 256 copies of one template fill their masks one after
# another whatever the thread count (run 16: 3.75 ms per step on 16 cores, against 1.1 ms for 64 schemas).
# So a constraint used by many requests is compiled into up to ``shards`` independent templates, each
# serving ``ROWS_PER_SHARD`` consecutive requests in turn; a constraint of a few requests is compiled once.
ROWS_PER_SHARD = 4


@dataclass
class _Constraint:
    text: str | None = None  # llguidance's grammar, made at the first compile
    templates: list[Future] = field(default_factory=list)
    requests: int = 0


def _key(spec: StructuredOutputsParams, frame: HarmonyFrame | None) -> str:
    return spec.key if frame is None else frame.key + "|" + spec.key


class GrammarCompiler:
    """``submit(spec)`` returns a future of the template matcher a request copies (``deep_copy``, cheap);
    equal constraints (by canonical JSON) share their templates.

    llguidance builds its tokenizer tables (about 1.7 s for a 151k vocabulary on one core) and each grammar
    with the GIL released, so compiling never stalls the step loop. Data-parallel replicas each have their
    own compiler.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int, workers: int = 2,
                 shards: int | None = None) -> None:
        self.vocab_size = vocab_size
        # twice the mask threads: fewer rows per lock than threads, so threads seldom wait on one another
        self.shards = shards if shards is not None else 2 * mask_threads()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmcli-grammar")
        self._tokenizer = self.pool.submit(self._make_tokenizer, tokenizer, list(eos_token_ids), vocab_size)
        self._cache: dict[str, _Constraint] = {}
        self.compile_seconds: dict[str, float] = {}  # per distinct constraint (its first template), for the bench

    @staticmethod
    def _make_tokenizer(tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> Any:
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer (or --tokenizer)")
        import llguidance.hf

        load_llguidance()  # the clear install message first
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)

    def submit(self, spec: StructuredOutputsParams, frame: HarmonyFrame | None = None) -> Future:
        """The template for the next request under ``spec`` (within ``frame``: a Harmony model's answer)."""
        key = _key(spec, frame)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = _Constraint()
        shard = (entry.requests // ROWS_PER_SHARD) % max(1, self.shards)
        entry.requests += 1
        while len(entry.templates) <= shard:
            entry.templates.append(self.pool.submit(self._compile, spec, entry, frame))
        return entry.templates[shard]

    def templates(self, spec: StructuredOutputsParams, frame: HarmonyFrame | None = None) -> int:
        """How many independent templates ``spec`` has so far."""
        entry = self._cache.get(_key(spec, frame))
        return len(entry.templates) if entry is not None else 0

    def _compile(self, spec: StructuredOutputsParams, entry: _Constraint, frame: HarmonyFrame | None = None) -> Any:
        tokenizer = self._tokenizer.result()
        start = time.perf_counter()
        if entry.text is None:
            entry.text = grammar_text(spec) if frame is None else frame.wrap(grammar_text(spec))
        try:
            matcher = load_llguidance().LLMatcher(tokenizer, entry.text, log_level=0, limits=parser_limits())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - llguidance's Rust panics (a grammar past its symbol limit)
            raise GrammarError(" ".join(str(exc).split())[:300] or type(exc).__name__) from None
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.compile_seconds.setdefault(_key(spec, frame), time.perf_counter() - start)
        return matcher

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
