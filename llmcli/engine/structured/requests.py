"""The engine's side of structured outputs: requests wait for their grammar, then their matchers follow
every accepted token and fill each step's mask."""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import torch

from llmcli.engine.sequence import Sequence
from llmcli.engine.structured.compiler import GrammarCompiler
from llmcli.engine.structured.harmony_grammar import FREE_TEXT, HarmonyFrame
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

    def add(self, seq: Sequence, frame: HarmonyFrame | None = None) -> None:
        """``frame``: a Harmony model's completion, whose final answer alone the constraint shapes (with no
        constraint, only the frame's thinking budget binds)."""
        spec = seq.params.structured_outputs or FREE_TEXT
        self.compiling.append((seq, self.compiler.submit(spec, frame)))

    def ready(self, block: bool) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The requests whose grammar is compiled, each with its own matcher, and those whose grammar failed
        to compile with why (that request's error, not the run's); ``block``: wait for one first (when
        nothing else could run, so that the step loop does not spin)."""
        if block and self.compiling:
            wait([f for _, f in self.compiling], timeout=5.0, return_when=FIRST_COMPLETED)
        # one look at each future: one that completes between two looks would land in neither list
        done, waiting = [], []
        for pair in self.compiling:
            (done if pair[1].done() else waiting).append(pair)
        self.compiling = waiting
        ready, failed = [], []
        for seq, future in done:
            error = future.exception()
            if error is not None:
                failed.append((seq, f"its constraint failed to compile: {error}"))
            else:
                seq.matcher = future.result().deep_copy()
                ready.append(seq)
        return ready, failed

    def fill(self, seqs: list[Sequence], pinned: bool) -> torch.Tensor | None:
        return self.masks.fill(seqs, pinned)

    def accept(self, seqs: list[Sequence], tokens: list[int]) -> dict[int, str]:
        """Advance each constrained sequence's matcher by its new token; the finish reason (by ``seq_id``) of
        those whose grammar ends the request there: "stop" where the grammar is complete, "abort" where the
        matcher could not go on (its token is not part of the output)."""
        pairs, ends = [], {}
        for seq, token in zip(seqs, tokens):
            if seq.matcher is None or seq.is_finished:
                continue
            if seq.matcher.is_error():  # its mask failed (a parser limit): the row allowed only EOS
                self._abort(seq, token)
                ends[seq.seq_id] = "abort"
            else:
                pairs.append((seq, token))
        for (seq, token), ok in zip(pairs, self.masks.accept([(seq.matcher, token) for seq, token in pairs])):
            if not ok:  # a parser limit while consuming, or (a bug) a token the mask did not allow
                self._abort(seq, token)
                ends[seq.seq_id] = "abort"
            elif seq.matcher.is_stopped():
                ends[seq.seq_id] = "stop"
        return ends

    @staticmethod
    def _abort(seq: Sequence, token: int) -> None:
        error = seq.matcher.get_error()
        first = error.strip().splitlines()[0] if error.strip() else "no error message"
        log.warning("request %r: its grammar matcher failed (%s, %s) at token %d; the request ends there with "
                    "finish_reason 'abort'", seq.request_id, first, seq.matcher.stop_reason(), token)

    def shutdown(self) -> None:
        self.compiler.shutdown()
