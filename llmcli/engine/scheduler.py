"""Scheduler: which sequences run this step, and how many tokens each."""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from llmcli.config import Config
from llmcli.engine.block_manager import BlockManager
from llmcli.engine.outputs import EngineStats
from llmcli.engine.plan_builder import PlanBuilder
from llmcli.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from llmcli.engine.state_pages import StatePages
from llmcli.engine.state_pool import has_linear_layers, num_snapshot_slots
from llmcli.engine.state_snapshots import WAIT, SnapshotRegistry
from llmcli.engine.step_plan import StepPlan

# Admission in groups. A step that admits prompts while others decode is a prefill step, run eagerly: it costs a
# fixed host overhead over a decode step (CUDA graphs replay decode only), ~250 ms against a 43 ms decode step
# on Qwen3.6-27B, whose Gated DeltaNet layers launch ~20 kernels each through fla (2026-12-04 calls R1/R1b in
# benchmarks/RESULTS.md). Admitting each prompt as one sequence finishes pays it per prompt; a slot left idle a
# few steps costs 1/running of a step each. So while others decode, a prompt that could start waits until a
# sixteenth of the running batch can start with it (slots and KV blocks), or every waiting prompt can, or it has
# waited HOLD_STEPS.
GROUP_FRACTION = 16
HOLD_STEPS = 32


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool  # True: one varlen batch of chunks (prefill, or mixed); False: one token per sequence
    num_tokens: int  # tokens computed this step
    sampled: list[Sequence]  # the sequences that get a token this step (all but a prompt cut by the budget)
    num_decode: int = 0  # a mixed step: its first ``num_decode`` sequences decode one token each
    plan: StepPlan | None = None  # what the model runner reads of this step (entries in the order of ``seqs``)


class Scheduler:
    """Prefill first (chunked to the token budget), otherwise one decode token for every running sequence;
    or, with ``mixed_steps``, one decode token for every running sequence and prompt chunks in what is left
    of the budget, in the same step (decoding never pauses while prompts prefill).

    A prompt is admitted once all its blocks can be allocated (in a sliding-window KV group: its window's and
    one more; each chunk then takes its own, and blocks behind the window go back as it advances); if the
    budget runs out inside it, it stays at the head of the waiting queue holding its
    blocks and continues next step. When decode runs out of blocks, the most
    recently admitted sequence is preempted: its blocks are freed and it is
    recomputed later from its tokens, so no generated token is lost.
    """

    def __init__(self, config: Config, num_blocks: int, stats: EngineStats,
                 kv_windows: tuple[int | None, ...] = (None,), state_pages: StatePages | None = None) -> None:
        """``kv_windows``: the KV groups' windows (engine/kv_groups.py; the runner's ``MemoryReport.kv_groups``);
        ``state_pages``: a hybrid model's state rows in the pool (engine/state_pages.py)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.mixed_steps = config.mixed_steps
        # a prefix hit skips tokens whose linear-attention state must then come from a snapshot: a hybrid model
        # without snapshot slots computes every prompt token
        snapshots = num_snapshot_slots(config)
        caching = config.enable_prefix_caching and (snapshots > 0 or not has_linear_layers(config.hf_config))
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, caching, kv_windows, state_pages)
        self.snapshots = SnapshotRegistry(snapshots, config.kvcache_block_size) if snapshots else None
        self.plans = PlanBuilder(config.kvcache_block_size, self.block_manager.freed_rows, len(kv_windows))
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = stats
        self.steps = 0  # steps scheduled
        self.held_since: int | None = None  # the step since which an admissible prompt waits for company

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step, with its plan (None when nothing can run)."""
        batch = self._schedule()
        self.steps += 1
        if len(self.running) > self.stats.peak_running:
            self.stats.peak_running = len(self.running)
        if batch is not None:
            batch.plan = self.plans.prefill(batch.seqs, batch.sampled) if batch.is_prefill \
                else self.plans.decode(batch.seqs)
            if self.snapshots is not None and batch.is_prefill:
                self.snapshots.plan(batch.plan, batch.seqs)
        return batch

    def _schedule(self) -> ScheduledBatch | None:
        if self.mixed_steps:
            return self._schedule_mixed()
        batch, tokens, sampled = self._schedule_prefill(self.max_num_batched_tokens)
        if batch:
            return ScheduledBatch(batch, True, tokens, sampled)
        batch = self._schedule_decode()
        return ScheduledBatch(batch, False, len(batch), batch) if batch else None

    def _schedule_mixed(self) -> ScheduledBatch | None:
        decode = self._schedule_decode()
        prefill, tokens, sampled = self._schedule_prefill(self.max_num_batched_tokens - len(decode))
        if not prefill:
            return ScheduledBatch(decode, False, len(decode), decode) if decode else None
        return ScheduledBatch(decode + prefill, True, len(decode) + tokens, decode + sampled, num_decode=len(decode))

    def _schedule_prefill(self, budget: int) -> tuple[list[Sequence], int, list[Sequence]]:
        """Prompt chunks within ``budget`` tokens: (sequences, tokens, those of them that sample this step)."""
        batch: list[Sequence] = []
        start = budget
        manager = self.block_manager
        # an admitted prompt is in ``running`` already (counting ``batch`` too halved the free slots a step fills)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token still in flight: recompute once it is known
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq, budget):
                    break
                if not batch and self._hold(budget):
                    break
                cached = self._snapshot_depth(seq) if self.snapshots is not None else None
                if cached == WAIT:
                    break
                hit = self.block_manager.allocate(seq, budget, cached)
                self.stats.prefix_cache_queried_tokens += seq.num_tokens
                self.stats.prefix_cache_hit_tokens += hit
            done = seq.num_computed_tokens
            # a window group holds only the chunk's blocks (and its window's): the pool may cut the chunk short
            end = self.block_manager.grow(seq, done + min(seq.num_tokens - done, budget))
            if end <= done:
                break
            seq.num_scheduled_tokens = end - done
            budget -= seq.num_scheduled_tokens
            batch.append(seq)
            if manager.enable_prefix_caching and end // manager.block_size > seq.num_hashed_blocks:
                # published now, not at launch: a prompt later in this very batch may start from them (every
                # backend stores a layer's K/V for the whole batch before any of it attends), so requests
                # added together that share a context (one question's choices) compute it once
                manager.register_computed(seq, end)
            if not seq.samples_this_step:
                # a chunk of a longer prompt: the budget is spent, it continues next step (so only the last
                # sequence of a prefill batch can be one that does not sample)
                return batch, start - budget, batch[:-1]
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return batch, start - budget, batch

    def _hold(self, budget: int) -> bool:
        """Whether a prompt that could be admitted now waits for others to start with it: while others run, a
        group is a sixteenth of them, or every waiting prompt, or what the step's token ``budget`` holds of the
        queue (at least one prompt), whichever is fewest (``GROUP_FRACTION``)."""
        running = len(self.running)
        group = min(len(self.waiting), -(-running // GROUP_FRACTION))
        fits = 0
        for seq in itertools.islice(self.waiting, group):
            budget -= seq.num_tokens - seq.num_computed_tokens
            if budget < 0:
                break
            fits += 1
        group = max(1, min(group, fits))
        room = min(self.max_num_seqs - running, self.block_manager.admissible(self.waiting, group))
        if not running or room >= group:
            self.held_since = None
            return False
        if self.held_since is None:
            self.held_since = self.steps
        if self.steps - self.held_since >= HOLD_STEPS:
            self.held_since = None
            return False
        return True

    def _snapshot_depth(self, seq: Sequence) -> int | None:
        """A hybrid model's prefix hit: the blocks ``seq`` may take from the cache (its deepest state
        snapshot), or ``WAIT`` (a deeper one is being written)."""
        if not seq.params.reads_prefix_cache:
            return None
        # a request that may take only the first blocks (prompt_logprobs_start) sees its prompt end there: its
        # snapshots are taken at most that deep (where its siblings' hits end too), and it waits only for those
        hashes = self.snapshots.hashes(seq)[:self.block_manager.hit_limit(seq)]
        return self.snapshots.admit(seq, hashes, self.block_manager.cached_blocks(seq))

    def _schedule_decode(self) -> list[Sequence]:
        running = self.running
        # Runs once per sequence per decode step. Most steps change nothing: every running sequence is short
        # of its limits and its blocks hold its next token (``decode_until``), and the batch is the whole
        # queue in order; only a step where some sequence reaches that length takes the loop below.
        if len(running) <= self.max_num_seqs:
            batch = list(running)
            for seq in batch:
                if len(seq.token_ids) >= seq.decode_until:
                    break
                seq.num_scheduled_tokens = 1
            else:
                return batch
        batch = []
        done: list[Sequence] = []  # at a length limit, waiting only for their last token to be read back
        manager, max_len = self.block_manager, self.max_model_len
        block_size = manager.block_size
        max_num_seqs, append = self.max_num_seqs, batch.append
        while running and len(batch) < max_num_seqs:
            seq = running.popleft()
            n = len(seq.token_ids)
            if n >= seq.decode_until:  # the checks that decode_until stands for
                limit = seq.params.max_tokens
                end = max_len if limit is None else min(max_len, seq.num_prompt_tokens + limit)
                if n >= end:  # no further token may be generated
                    done.append(seq)
                    continue
                if n > len(seq.block_table) * block_size and not self._make_room(seq):
                    continue  # preempted itself
                seq.decode_until = min(end, len(seq.block_table) * block_size + 1)
            seq.num_scheduled_tokens = 1
            append(seq)
        running.extendleft(reversed(batch + done))
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        """Give ``seq`` the block its next token needs, preempting the newest others (or itself) if short."""
        while not self.block_manager.can_append(seq):
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())
        self.block_manager.append_slot(seq)
        return True

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.snapshots is not None:
            self.snapshots.release(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, KV blocks and state snapshots (benchmarks: each run starts cold)."""
        self.block_manager.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        # a prompt cut mid-prefill holds its blocks at the head of the queue (and may need a few more for its
        # window): it stays first, or behind a preempted sequence that cannot get blocks nothing would run again
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)
        self.stats.num_preemptions += 1

    def launched(self, seqs: list[Sequence], sampled: list[Sequence]) -> list[int]:
        """The scheduled tokens of ``seqs`` are launched (their K/V is being written to the cache), and each of
        ``sampled`` gets a placeholder for the token it gets in row ``i`` of the step's output; returns where
        those tokens go.

        Runs once per sequence per step, so the methods it stands for are inlined; the prefix cache is only
        asked when a block has filled up.
        """
        manager = self.block_manager
        caching, block_size = manager.enable_prefix_caching, manager.block_size
        slide = manager.slide if manager.has_windows else None  # window groups give back what fell out
        indices = []
        if seqs is sampled:  # every sequence samples (a decode step, or prompts that all finish): one pass
            for row, seq in enumerate(seqs):
                # it samples, so its scheduled tokens reach the last known one: the new token's index is the
                # computed count
                computed = seq.num_computed_tokens + seq.num_scheduled_tokens
                seq.num_computed_tokens = computed
                seq.num_scheduled_tokens = 0
                if caching and computed // block_size > seq.num_hashed_blocks:
                    manager.register_computed(seq)
                if slide is not None and computed >= seq.slide_at:
                    slide(seq)
                seq.token_ids.append(PENDING_TOKEN)
                seq.num_pending += 1
                seq.pending_row = row
                indices.append(computed)
            return indices
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if caching and seq.num_computed_tokens // block_size > seq.num_hashed_blocks:
                manager.register_computed(seq)
            if slide is not None and seq.num_computed_tokens >= seq.slide_at:
                slide(seq)
        for row, seq in enumerate(sampled):
            tokens = seq.token_ids
            tokens.append(PENDING_TOKEN)
            seq.num_pending += 1
            seq.pending_row = row
            indices.append(len(tokens) - 1)
        return indices

    def finish(self, seq: Sequence) -> None:
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        seq.status = SequenceStatus.FINISHED
        self._release(seq)
        queue.remove(seq)
