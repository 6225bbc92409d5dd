"""Scheduler: which sequences run this step, and how many tokens each."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmcli.config import Config
from llmcli.engine.block_manager import BlockManager
from llmcli.engine.outputs import EngineStats
from llmcli.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)


class Scheduler:
    """Prefill first (chunked to the token budget), otherwise one decode token for every running sequence.

    A prompt is admitted once all its blocks can be allocated; if the budget
    runs out inside it, it stays at the head of the waiting queue holding its
    blocks and continues next step. When decode runs out of blocks, the most
    recently admitted sequence is preempted: its blocks are freed and it is
    recomputed later from its tokens, so no generated token is lost.
    """

    def __init__(self, config: Config, num_blocks: int, stats: EngineStats) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = stats

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch:
            return ScheduledBatch(batch, is_prefill=True)
        batch = self._schedule_decode()
        return ScheduledBatch(batch, is_prefill=False) if batch else None

    def _schedule_prefill(self) -> list[Sequence]:
        budget, batch = self.max_num_batched_tokens, []
        while self.waiting and budget > 0 and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token still in flight: recompute once it is known
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                hit = self.block_manager.allocate(seq)
                self.stats.prefix_cache_queried_tokens += seq.num_tokens
                self.stats.prefix_cache_hit_tokens += hit
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            batch.append(seq)
            if not seq.samples_this_step:
                break  # a chunk of a longer prompt: the budget is spent, it continues next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        done: list[Sequence] = []  # at a length limit, waiting only for their last token to be read back
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            if seq.length_limit_reached(self.max_model_len):
                done.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        self.running.extendleft(reversed(batch + done))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def step_done(self, seq: Sequence) -> None:
        """The scheduled tokens of ``seq`` are launched: their K/V is (being) written to the cache."""
        seq.num_computed_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        self.block_manager.register_computed(seq)

    def finish(self, seq: Sequence) -> None:
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        queue.remove(seq)
