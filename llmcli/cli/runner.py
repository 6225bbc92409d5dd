"""The generation loop: feeds prepared requests to the engine and hands each finished record to the writer."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol

from llmcli.engine.outputs import RequestOutput
from llmcli.engine.sequence import RequestRejected
from llmcli.cli.io.output import error_record, result_record
from llmcli.cli.io.prepare import PreparedRequest
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.background_writer import BackgroundWriter


class ProgressSink(Protocol):
    def advance(self, n: int = 1) -> None: ...
    def update(self, stats: Any) -> None: ...


@dataclass
class RunCounts:
    answered: int = 0
    failed: int = 0
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

    def __init__(self, engine: Any, writer: BackgroundWriter, progress: ProgressSink, *, model: str,
                 include_token_ids: bool, window: int, stop: StopFlag) -> None:
        self.engine = engine
        self.writer = writer
        self.progress = progress
        self.model = model
        self.include_token_ids = include_token_ids
        self.window = max(1, window)
        self.stop = stop
        self.counts = RunCounts()
        self._groups: dict[int, list[RequestOutput | None]] = {}
        self._requests: dict[int, PreparedRequest] = {}
        self._inflight = 0
        self._exhausted = False
        self.rejected: list[InputRecord] = []  # records the engine refused when their turn came

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
                self.progress.update(self.engine.stats)
        except KeyboardInterrupt:
            self.stop.requested, self.stop.signal_name = True, "SIGINT"
        except Exception:
            # Tensor-parallel workers share the terminal's process group and may die of the same
            # Ctrl-C first; a step failing after a stop request is part of that stop.
            if not self.stop.requested:
                raise
        if self.stop.requested:
            self.counts.interrupted, self.counts.signal_name = True, self.stop.signal_name
            # Finished work is final even if an earlier record is not: keep it, --resume fills the gaps.
            self.writer.drain()
        return self.counts

    def _admit(self, pending: Iterator) -> None:
        while not self._exhausted and self._inflight < self.window:
            nxt = next(pending, None)
            if nxt is None:
                self._exhausted = True
                return
            position, item = nxt
            if isinstance(item, InputRecord):
                self._write_error(position, item)
                continue
            try:
                if len(item.params) > 1:  # all n checked before any is queued (add_request checks one)
                    for params in item.params:
                        self.engine.check_fits(item.prompt_token_ids, params)
                for i, params in enumerate(item.params):
                    self.engine.add_request(item.prompt_token_ids, params, request_id=f"{position}.{i}")
            except RequestRejected as exc:  # can never run with this model or KV pool
                item.record.fail(item.record.prompt_field(), str(exc))
                self.rejected.append(item.record)
                self._write_error(position, item.record)
                continue
            self._groups[position] = [None] * len(item.params)
            self._requests[position] = item
            self._inflight += len(item.params)

    def _collect(self, out: RequestOutput) -> None:
        position, _, index = str(out.request_id).partition(".")
        position, index = int(position), int(index)
        group = self._groups.get(position)
        if group is None:
            return
        group[index] = out
        self._inflight -= 1
        if all(o is not None for o in group):
            item = self._requests.pop(position)
            del self._groups[position]
            # Built in the writer's thread, after it has decoded the texts of a batch of outputs.
            make = lambda rec=item.record, outs=group: result_record(  # noqa: E731
                rec, outs, model=self.model, include_token_ids=self.include_token_ids)
            self.writer.put(position, make, group)
            self.counts.answered += 1
            self.progress.advance(1)

    def _write_error(self, position: int, rec: InputRecord) -> None:
        self.writer.put(position, lambda: error_record(rec))
        self.counts.failed += 1
        self.progress.advance(1)
