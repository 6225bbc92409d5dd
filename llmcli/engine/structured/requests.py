"""The engine's side of structured outputs: requests wait for their grammar, then their matchers follow
every accepted token and fill each step's mask."""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import numpy as np

from llmcli.engine.sequence import Sequence
from llmcli.engine.structured.compiler import GrammarCompiler
from llmcli.engine.structured.grammar import GrammarError
from llmcli.engine.structured.masks import ConstrainedBatch

log = logging.getLogger("llmcli")


class StructuredRequests:
    """Constrained requests before the scheduler sees them (grammar compiling) and after (matchers)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> None:
        self.compiler = GrammarCompiler(tokenizer, eos_token_ids, vocab_size)
        self.masks = ConstrainedBatch(vocab_size)
        self.compiling: list[tuple[Sequence, Any]] = []

    @property
    def num_compiling(self) -> int:
        return len(self.compiling)

    def add(self, seq: Sequence) -> None:
        self.compiling.append((seq, self.compiler.submit(seq.params.structured_outputs)))

    def ready(self, block: bool) -> list[Sequence]:
        """The requests whose grammar is compiled, each with its own matcher; ``block``: wait for one first
        (when nothing else could run, so that the step loop does not spin)."""
        if block and self.compiling:
            wait([f for _, f in self.compiling], timeout=5.0, return_when=FIRST_COMPLETED)
        done, self.compiling = ([(s, f) for s, f in self.compiling if f.done()],
                                [(s, f) for s, f in self.compiling if not f.done()])
        for seq, future in done:
            error = future.exception()
            if error is not None:
                raise GrammarError(f"request {seq.request_id!r}: its constraint failed to compile: {error}")
            seq.matcher = future.result().deep_copy()
        return [seq for seq, _ in done]

    def fill(self, seqs: list[Sequence]) -> np.ndarray | None:
        return self.masks.fill(seqs)

    @staticmethod
    def accept(seq: Sequence, token: int) -> str | None:
        """Advance ``seq``'s matcher by its new token; a finish reason if the grammar ends the request here."""
        matcher = seq.matcher
        if not matcher.consume_token(token):
            # The mask allows only tokens the matcher takes, so this is a bug, not bad input: end the
            # request rather than let it go on unconstrained.
            log.warning("request %r: token %d broke its grammar (%s); it ends here", seq.request_id, token,
                        matcher.get_error())
            return "abort"
        return "stop" if matcher.is_stopped() else None

    def shutdown(self) -> None:
        self.compiler.shutdown()
