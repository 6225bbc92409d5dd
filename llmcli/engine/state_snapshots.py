"""Prefix caching for hybrid models: snapshots of the linear-attention layers' state at block boundaries.

A KV prefix hit skips tokens; a Gated DeltaNet layer can only skip them if some slot holds its conv and
recurrent state right after them. A snapshot is such a copy, keyed by the chained hash of the block boundary
it follows (``block_manager.chain_hash``), kept in extra slots of the state pool (``engine/state_pool.py``).
A hit's depth is the deepest readable snapshot at or above the KV match; KV blocks past it are recomputed.

Snapshots are taken while a prompt is computed, at two boundaries chosen at admission (one per boundary and
hash at a time: the creator): where the request's KV match ends without a snapshot (the branching point that
every later request sharing that prefix hits), and the last block boundary before its last token (identical
prompts, the next turn of a conversation). The step that computes that boundary's token writes the snapshot
(the runner splits the chunk there, layers/state_segments.py); it is readable from the next step on: unlike a
KV block, a recurrent state cannot be read by the very step that writes it. A request whose better snapshot is
being written waits one step at the head of the queue rather than compute the shared prefix again.

Slots are few (one is a whole sequence's state: ~48 MiB on Qwen3.5-9B), so they are recycled least recently
used first; one that a step being planned reads or writes is not recycled in that step.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmcli.engine.block_manager import chain_hash
from llmcli.engine.sequence import Sequence
from llmcli.engine.step_plan import StepPlan

WAIT = -1  # ``SnapshotRegistry.admit``: the request should wait a step for a snapshot being written


@dataclass
class Snapshot:
    slot: int  # snapshot index (the state pool's slot ``max_num_seqs + 1 + slot``)
    written: int = -1  # the step whose plan writes it (-1: not planned yet)
    used: int = -1  # the last step that reads or writes it (not recycled in that step)


class SnapshotRegistry:
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.by_hash: OrderedDict[int, Snapshot] = OrderedDict()  # least recently used first
        self.step = 0  # the step being planned
        self.taken = 0  # snapshots written (EngineStats)
        self.hits = 0  # admissions that started from a snapshot

    def _readable(self, h: int) -> Snapshot | None:
        snap = self.by_hash.get(h)
        return snap if snap is not None and 0 <= snap.written < self.step else None

    def hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of ``seq``'s full blocks before its last token (the boundaries a hit may use)."""
        out, prev = [], 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            prev = chain_hash(prev, seq.block_tokens(i))
            out.append(prev)
        return out

    def admit(self, seq: Sequence, hashes: list[int], kv_blocks: int) -> int:
        """How many leading blocks ``seq`` may take from the prefix cache (``kv_blocks`` of its ``hashes`` are
        there), or ``WAIT``. Sets ``seq``'s snapshot to start from and the snapshots it is to take."""
        depth = next((k for k in range(kv_blocks, 0, -1) if self._readable(hashes[k - 1]) is not None), 0)
        if any(h in self.by_hash and self._readable(h) is None for h in hashes[depth:]):
            return WAIT  # a deeper snapshot of this prompt is being written: the next step starts from it
        if depth:
            snap = self.by_hash[hashes[depth - 1]]
            snap.used = self.step
            self.by_hash.move_to_end(hashes[depth - 1])
            seq.state_source = snap.slot
            self.hits += 1
        # the branching point (this request's KV match without a snapshot), then the end of the prompt
        for blocks in dict.fromkeys((kv_blocks, len(hashes))):
            if blocks > depth and hashes[blocks - 1] not in self.by_hash:
                snap = self._take(hashes[blocks - 1])
                if snap is not None:
                    seq.snapshot_writes.append((blocks * self.block_size, hashes[blocks - 1], snap))
        return depth

    def _take(self, h: int) -> Snapshot | None:
        """A slot for a new snapshot under ``h``: a free one, else the least recently used one not in use."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            old = next((k for k, s in self.by_hash.items() if 0 <= s.written < self.step and s.used < self.step),
                       None)
            if old is None:
                return None
            slot = self.by_hash.pop(old).slot
        snap = self.by_hash[h] = Snapshot(slot, used=self.step)
        return snap

    def plan(self, plan: StepPlan, seqs: list[Sequence]) -> None:
        """Put the step's snapshot reads and writes into ``plan`` (entries in the order of ``seqs``); the step
        is planned."""
        for i, seq in enumerate(seqs):
            if seq.state_source >= 0:  # its first chunk, in the step that admitted it
                plan.state_reads.append((i, seq.state_source))
                seq.state_source = -1
            if seq.snapshot_writes:
                start = seq.num_computed_tokens
                end = start + seq.num_scheduled_tokens
                for write in [w for w in seq.snapshot_writes if start < w[0] <= end]:
                    pos, _, snap = write
                    plan.state_writes.append((i, pos - start, snap.slot))
                    snap.written = snap.used = self.step
                    seq.snapshot_writes.remove(write)
                    self.taken += 1
        self.step += 1

    def release(self, seq: Sequence) -> None:
        """``seq`` gives its blocks back (finished or preempted): snapshots it has not written yet are dropped."""
        for _, h, snap in seq.snapshot_writes:
            if self.by_hash.get(h) is snap:
                del self.by_hash[h]
                self.free_slots.append(snap.slot)
        seq.snapshot_writes = []
        seq.state_source = -1

    def clear(self) -> None:
        """Forget every snapshot (with the KV prefix cache: ``Scheduler.reset_prefix_cache``)."""
        for snap in self.by_hash.values():
            self.free_slots.append(snap.slot)
        self.by_hash.clear()
