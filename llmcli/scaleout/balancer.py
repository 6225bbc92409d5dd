"""Which data-parallel replica gets the next request: the one with the fewest outstanding tokens.

A request's cost is what it may put on a replica: its prompt tokens plus the
tokens it may generate (``max_tokens``, or what is left of ``max_model_len``
when it has none). Counting tokens rather than requests keeps a run of long
prompts from piling onto one replica while another works through short ones.
A request stops counting once its answer is back (or its replica is lost).

Pure bookkeeping, no processes: the data-parallel engine asks ``assign`` for
every request it sends, tells ``done`` about every answer, and ``remove``
when a replica is lost (which hands back that replica's unanswered requests).
"""
from __future__ import annotations

from typing import Any, Hashable

from llmcli.sampling_params import SamplingParams


def request_cost(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """Prompt tokens plus the most tokens the request may generate (bounded by ``max_model_len``)."""
    room = max(1, max_model_len - num_prompt_tokens)
    new = room if params.max_tokens is None else min(params.max_tokens, room)
    return num_prompt_tokens + new


class OutstandingTokenBalancer:
    """Outstanding tokens per replica, and which replica holds which request."""

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError("a balancer needs at least one replica")
        self.load = [0] * replicas  # outstanding tokens per replica
        self.count = [0] * replicas  # outstanding requests per replica (tie-break, and for reports)
        self.alive = [True] * replicas
        self._where: dict[Hashable, tuple[int, int]] = {}  # request id -> (replica, cost)

    @property
    def live(self) -> list[int]:
        return [r for r, ok in enumerate(self.alive) if ok]

    def pick(self) -> int:
        """The live replica with the fewest outstanding tokens (then fewest requests, then lowest index)."""
        live = self.live
        if not live:
            raise RuntimeError("no replica is left to take requests")
        return min(live, key=lambda r: (self.load[r], self.count[r], r))

    def assign(self, request_id: Hashable, cost: int) -> int:
        """Charge ``cost`` tokens to the least loaded replica and return it."""
        if request_id in self._where:
            raise ValueError(f"request {request_id!r} is already outstanding")
        replica = self.pick()
        self._where[request_id] = (replica, cost)
        self.load[replica] += cost
        self.count[replica] += 1
        return replica

    def done(self, request_id: Hashable) -> int | None:
        """The answer is back: release its tokens. Returns the replica that held it (None if unknown)."""
        entry = self._where.pop(request_id, None)
        if entry is None:
            return None
        replica, cost = entry
        self.load[replica] -= cost
        self.count[replica] -= 1
        return replica

    def replica_of(self, request_id: Hashable) -> int | None:
        entry = self._where.get(request_id)
        return entry[0] if entry is not None else None

    def remove(self, replica: int) -> list[Any]:
        """Take ``replica`` out of rotation; returns its unanswered request ids, in the order they were assigned."""
        self.alive[replica] = False
        orphans = [rid for rid, (r, _) in self._where.items() if r == replica]
        for rid in orphans:
            self.done(rid)
        return orphans
