"""The generation loop: feeds prepared requests to the engine and hands each finished record to the writer."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol

from llmcli.engine.engine_api import EngineAPI
from llmcli.engine.outputs import ModelFailure, RequestOutput
from llmcli.engine.sequence import RequestRejected
from llmcli.cli.io.output import error_record, result_record
from llmcli.scaleout.errors import ReplicaFailure
from llmcli.cli.io.prepare import PreparedRequest
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.background_writer import BackgroundWriter
from llmcli.cli.prefix_hint import SharedPrefixes
from llmcli.cli.rejection import rejection


class ProgressSink(Protocol):
    def advance(self, n: int = 1, unused_tokens: int = 0) -> None: ...
    def update(self, stats: Any, pending: int = 0) -> None: ...
    def finish(self, stats: Any, pending: int = 0) -> None: ...


def token_budget(item: PreparedRequest, max_model_len: int) -> list[int]:
    """Most tokens each completion of ``item`` can generate: max_tokens, or what max_model_len leaves."""
    room = max(0, max_model_len - len(item.prompt_token_ids))
    return [room if p.max_tokens is None else min(p.max_tokens, room) for p in item.params]


@dataclass
class BudgetGuess:
    """Records from position ``first`` on are not prepared yet when the run starts: each is counted as
    ``tokens`` of budget and one completion until its turn comes."""

    first: int = 1 << 62
    tokens: int = 0
    pending_seqs: int = 0  # completions not yet handed to the engine, guessed ones included
    total: int = 0  # the run's whole token budget, guessed part included


@dataclass
class RunCounts:
    answered: int = 0
    failed: int = 0
    default_limited: int = 0  # answered records cut at a length limit they did not set themselves
    block_size_hint: str | None = None  # prompts share a prefix shorter than a KV block (prefix_hint.py)
    interrupted: bool = False
    signal_name: str = ""


class StopFlag:
    """SIGINT / SIGTERM ask the loop to stop after the current step; a second SIGINT stops at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # started under nohup or in the background: the user asked not to be interrupted
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: keep Python's default handling
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name


class Runner:
    """Keeps the engine busy with at most ``window`` sequences in flight and writes results as they finish.

    Feeding the input a window at a time keeps a huge input out of the
    engine's queues (requests not yet added cost nothing if the run is
    interrupted) while leaving enough waiting for the scheduler to fill its
    batches.
    """

    def __init__(self, engine: EngineAPI, writer: BackgroundWriter, progress: ProgressSink, *, model: str,
                 include_token_ids: bool, window: int, stop: StopFlag, include_metrics: bool = False,
                 reasoning: str | None = None, max_model_len: int = 0, guess: BudgetGuess | None = None,
                 token_bytes: Any = None, reasoning_field: str = "reasoning", block_size: int = 0) -> None:
        """``block_size``: the prefix cache's block, to tell when prompts share less than one (0: no cache)."""
        self.engine = engine
        self.writer = writer
        self.progress = progress
        self.model = model
        self.include_token_ids = include_token_ids
        self.include_metrics = include_metrics
        self.reasoning = reasoning
        self.reasoning_field = reasoning_field
        self.token_bytes = token_bytes  # chat logprobs' bytes: TokenBytes of the model's tokenizer
        self.window = max(1, window)
        self.stop = stop
        self.counts = RunCounts()
        self._groups: dict[int, list[RequestOutput | None]] = {}
        self._requests: dict[int, PreparedRequest] = {}
        # Per record: completions still running, and each one's token budget (computed once: a record of
        # n completions must cost O(n), not O(n) per completion).
        self._missing: dict[int, int] = {}
        self._ids: dict[str, tuple[int, int]] = {}  # engine request id -> (position, completion index)
        self._budgets: dict[int, list[int]] = {}
        self._inflight = 0
        self._exhausted = False
        self.rejected: list[InputRecord] = []  # records the engine refused when their turn came
        self.max_model_len = max_model_len
        self.guess = guess or BudgetGuess()
        self._pending_seqs = self.guess.pending_seqs  # completions of the run not yet handed to the engine
        self.prefixes = SharedPrefixes(block_size) if block_size else None

    def run(self, items: Iterable[tuple[int, PreparedRequest | InputRecord]]) -> RunCounts:
        """Answer every ``(position, item)``; positions are output order, 0, 1, 2, ... each once."""
        pending = iter(items)
        self._exhausted = False
        try:
            while not self.stop.requested:
                self._admit(pending)
                if not self.engine.has_unfinished():
                    if self._exhausted:
                        break
                    continue
                for out in self.engine.step():
                    self._collect(out)
                self.writer.check()  # a pipe's reader gone (| head): stop now, not when the next record is done
                self.progress.update(self.engine.stats, self._pending_seqs)
        except KeyboardInterrupt:
            self.stop.requested, self.stop.signal_name = True, "SIGINT"
        except Exception:
            # Tensor-parallel workers share the terminal's process group and may die of the same
            # Ctrl-C first; a step failing after a stop request is part of that stop.
            if not self.stop.requested:
                raise
        if self.stop.requested:
            self.counts.interrupted, self.counts.signal_name = True, self.stop.signal_name
        # Finished work is final even if an earlier record is not (interrupted: --resume fills the gaps); and
        # the last progress frame counts the records in OUT.
        self.writer.drain()
        self.progress.finish(self.engine.stats, self._pending_seqs)
        if self.prefixes is not None:
            self.counts.block_size_hint = self.prefixes.hint(self.engine.stats.prefix_cache_hit_rate)
        return self.counts

    def _admit(self, pending: Iterator) -> None:
        while not self._exhausted and self._inflight < self.window:
            nxt = next(pending, None)
            if nxt is None:
                self._exhausted = True
                return
            position, item = nxt
            self._revise_guess(position, item)
            if isinstance(item, InputRecord):
                self._write_error(position, item)
                continue
            self._pending_seqs -= len(item.params)
            i = 0
            try:
                if len(item.params) > 1:  # all n checked before any is queued (add_request checks one)
                    for i, params in enumerate(item.params):
                        self.engine.check_fits(item.prompt_of(i), params)
                for i, params in enumerate(item.params):
                    # The id names the record as the user knows it (the engine's warnings quote it).
                    rid = f"line {item.record.line}" + (f" completion {i}" if len(item.params) > 1 else "")
                    self._ids[rid] = (position, i)
                    self.engine.add_request(item.prompt_of(i), params, request_id=rid)
            except RequestRejected as exc:  # can never run with this model or KV pool
                item.record.fail(*rejection(item, i, exc))
                budget = self._budget(item)
                self.rejected.append(item.record)
                self._write_error(position, item.record, unused=sum(budget))
                continue  # siblings added before the rejection finish unseen: _collect ignores them
            if self.prefixes is not None:
                self.prefixes.observe(item.prompt_token_ids)
            self._groups[position] = [None] * len(item.params)
            self._requests[position] = item
            self._missing[position] = len(item.params)
            self._budgets[position] = self._budget(item)
            self._inflight += len(item.params)

    def _revise_guess(self, position: int, item: PreparedRequest | InputRecord) -> None:
        """A record counted by the guess is known now: its true budget and completions replace the guess's."""
        if position < self.guess.first:
            return
        exact = sum(self._budget(item)) if isinstance(item, PreparedRequest) else 0
        self.progress.revise_budget(exact - self.guess.tokens)
        self._pending_seqs += (len(item.params) if isinstance(item, PreparedRequest) else 0) - 1

    def _collect(self, out: RequestOutput) -> None:
        found = self._ids.pop(out.request_id, None)
        if found is None:
            return
        position, index = found
        group = self._groups.get(position)
        if group is None or group[index] is not None:
            return
        group[index] = out
        self._inflight -= 1
        item = self._requests[position]
        if out.error is not None:  # the record's error (its siblings, still running, finish unseen)
            self._inflight -= self._missing[position] - 1
            del self._requests[position], self._groups[position], self._missing[position], self._budgets[position]
            constraint = item.params[0].structured_outputs
            # not its fields' fault (a lost replica, non-finite logits): its prompt
            if constraint is None or isinstance(out.error, (ReplicaFailure, ModelFailure)):
                item.record.fail(item.record.prompt_field(), out.error)
            else:
                item.record.fail(item.record.structured_field or item.record.field_name("structured_outputs"),
                                 f"invalid {constraint.kind.replace('_', ' ')}: {out.error}")
            self.rejected.append(item.record)
            self._write_error(position, item.record, unused=sum(self._budget(item)))
            return
        self.progress.advance(0, unused_tokens=max(0, self._budgets[position][index] - len(out.token_ids)))
        self._missing[position] -= 1
        if not self._missing[position]:
            del self._requests[position], self._groups[position], self._missing[position], self._budgets[position]
            # Built in the writer's thread, after it has decoded the texts of a batch of outputs.
            make = lambda rec=item.record, outs=group: result_record(  # noqa: E731
                rec, outs, model=self.model, include_token_ids=self.include_token_ids,
                include_metrics=self.include_metrics, reasoning=self.reasoning, token_bytes=self.token_bytes,
                reasoning_field=self.reasoning_field)
            self.writer.put(position, make, group)
            self.counts.answered += 1
            if not item.limit_set and any(o.finish_reason == "length" for o in group):
                self.counts.default_limited += 1
            self.progress.advance(1)

    def _budget(self, item: PreparedRequest) -> list[int]:
        return token_budget(item, self.max_model_len)

    def _write_error(self, position: int, rec: InputRecord, unused: int = 0) -> None:
        self.writer.put(position, lambda: error_record(rec))
        self.counts.failed += 1
        self.progress.advance(1, unused_tokens=unused)
