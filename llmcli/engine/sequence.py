"""Sequence: the one holder of a request's state as it moves through the engine."""
from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import Any

from llmcli.sampling_params import SamplingParams


PENDING_TOKEN = -1  # stands in token_ids for a sampled token the device has not handed back yet


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or for the KV pool)."""


class PoolTooSmall(RequestRejected):
    """A request that may grow past the whole KV pool: more cache memory (or fewer tokens) is the fix.
    ``prompt_alone``: the prompt with one generated token already needs more blocks than the pool has;
    ``blocks``: what the request needs; ``pool``: the blocks the whole pool has."""

    def __init__(self, message: str, prompt_alone: bool = False, blocks: int = 0, pool: int = 0) -> None:
        super().__init__(message)
        self.prompt_alone, self.blocks, self.pool = prompt_alone, blocks, pool


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


class Sequence:
    """Token ids, KV bookkeeping and sampling settings of one request.

    ``num_computed_tokens`` tokens have their K/V in the cache (the first
    ``num_cached_tokens`` of them came from the prefix cache); a step computes
    ``num_scheduled_tokens`` more. When every known token is computed the step
    samples the next one.
    """

    # Its attributes are read once per sequence per step by the scheduler, the plan builder and the engine's
    # read-back: slots make those reads faster than an instance dict of forty keys (~4% of a decode step's host
    # time at batch 256, benchmarks/host_step_cpu.py)
    __slots__ = ("seq_id", "request_id", "token_ids", "num_prompt_tokens", "params", "block_size", "seed", "status",
                 "block_tables", "held_from", "slide_at", "table_row", "table_id", "decode_until",
                 "num_hashed_blocks", "last_block_hash", "state_source", "snapshot_writes", "num_computed_tokens",
                 "num_cached_tokens", "num_scheduled_tokens", "num_pending", "pending_row", "finish_reason",
                 "stop_reason", "text", "stop_scan_pos", "stop_ids", "stop_index", "matcher", "arrival_time",
                 "first_token_time", "finish_time", "logprob_blocks", "logprob_rows", "prompt_logprob_entries",
                 "prompt_logprobs_from", "prompt_logprobs_done", "banned_token_ids", "hold_ids", "wants_extras")

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int,
                 request_id: Any = None, seed: int = 0) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else self.seq_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.seed = seed  # per-request sampling seed (the user's, or one drawn by the engine)
        self.status = SequenceStatus.WAITING
        # one block table per KV group (engine/kv_groups.py), the first of them ``block_table``; a released
        # window block's entry is kv_groups.NULL_BLOCK
        self.block_tables: list[list[int]] = [[]]
        self.held_from: list[int] = [0]  # per group: the first block not released (window groups)
        self.slide_at = 0  # the computed count from which BlockManager.slide has a window block to give back
        self.table_row = -1  # this sequence's row in the runner's block tables while it holds blocks
        self.table_id = 0  # which allocation that row was last filled for (fresh on every allocate)
        # the scheduler's quick test: below this many tokens a decode step needs no new block and hits no
        # length limit (0: not known; reset whenever the blocks change hands)
        self.decode_until = 0
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        self.last_block_hash = 0  # chained hash of those blocks
        # hybrid models (engine/state_snapshots.py): the snapshot its first chunk starts from (-1: none), and the
        # snapshots it is to take, (token position, block hash, Snapshot)
        self.state_source = -1
        self.snapshot_writes: list[tuple[int, int, Any]] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_pending = 0  # sampled tokens still in flight on the device (placeholders in token_ids)
        self.pending_row = -1  # row of the newest in-flight token in its launch's output, -1 if none
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None  # set when a stop string cut the text
        self.stop_scan_pos = 0  # where the next stop-string search starts in the decoded completion
        # the step loop's quick test before StopChecker.check (set by StopChecker.set_gate; None: always check)
        self.stop_ids: frozenset[int] | None = None
        self.stop_index = 0
        self.matcher: Any = None  # a constrained request's llguidance matcher, once its grammar is compiled
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time = 0.0
        # logprobs, when asked for: per generated token its step's LogprobBlock and row there
        # (llmcli.engine.sampling_extras); per prompt token (logprob, rank, top ids, top logprobs)
        self.logprob_blocks: list[Any] = []
        self.logprob_rows: list[int] = []
        self.prompt_logprob_entries: list[tuple[float, int, list[int], list[float]]] = []
        # the first prompt position whose next-token logprob is wanted (SamplingParams.prompt_logprobs_start):
        # entry i of prompt_logprob_entries is position prompt_logprobs_from + i
        self.prompt_logprobs_from = min(max(0, (params.prompt_logprobs_start or 0) - 1),
                                        max(0, self.num_prompt_tokens - 1))
        self.prompt_logprobs_done = self.prompt_logprobs_from  # prompt positions whose logprobs are computed
        # set by the engine: bad_words as token ids, and the ids min_tokens holds back (EOS, stop tokens)
        self.banned_token_ids: list[int] = []
        self.hold_ids: list[int] = []
        # one flag for the step's quick test: does this request need anything beside the sampled token?
        self.wants_extras = params.logprobs is not None or params.prompt_logprobs is not None or params.has_penalties \
            or params.has_token_bias or params.min_tokens > 0

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def samples_this_step(self) -> bool:
        """The scheduled chunk reaches the last known token, so a new token is sampled."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def truncate(self, length: int) -> None:
        """Drop tokens past ``length`` (sampled speculatively after the sequence had already finished)."""
        del self.token_ids[length:]
        self.num_pending = self.token_ids.count(PENDING_TOKEN)  # list.count: it runs for every finished request
        self.pending_row = -1
