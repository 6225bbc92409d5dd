"""Compiling each distinct constraint once per engine, on a thread pool beside the step loop."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from llmcli.engine.structured.grammar import GrammarError, grammar_text, load_llguidance, parser_limits
from llmcli.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """``submit(spec)`` returns a future of a template matcher; equal constraints (by canonical JSON) share one.

    llguidance builds its tokenizer tables (about 1.7 s for a 151k vocabulary on one core) and each grammar
    with the GIL released, so compiling never stalls the step loop. Every request gets its own
    ``deep_copy`` of the template, which is cheap. Data-parallel replicas each have their own compiler.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int, workers: int = 2) -> None:
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmcli-grammar")
        self._tokenizer = self.pool.submit(self._make_tokenizer, tokenizer, list(eos_token_ids), vocab_size)
        self._cache: dict[str, Future] = {}
        self.compile_seconds: dict[str, float] = {}  # per distinct constraint, for the bench report

    @staticmethod
    def _make_tokenizer(tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> Any:
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer (or --tokenizer)")
        import llguidance.hf

        load_llguidance()  # the clear install message first
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        future = self._cache.get(spec.key)
        if future is None:
            future = self._cache[spec.key] = self.pool.submit(self._compile, spec)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        tokenizer = self._tokenizer.result()
        start = time.perf_counter()
        matcher = load_llguidance().LLMatcher(tokenizer, grammar_text(spec), log_level=0,
                                             limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.compile_seconds[spec.key] = time.perf_counter() - start
        return matcher

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
