"""BlockManager: where each sequence's K/V lives in the fixed pool, with prefix sharing."""
from __future__ import annotations

from array import array
import itertools
from collections import OrderedDict
from collections.abc import Iterable

import xxhash

from llmcli.engine.kv_groups import NULL_BLOCK, blocks_needed, window_start_block
from llmcli.engine.sequence import PENDING_TOKEN, Sequence
from llmcli.engine.state_pages import FreshPages, StatePages, StateRows


def chain_hash(prev: int, tokens: list[int]) -> int:
    """Hash of a block that also covers every block before it (through ``prev``)."""
    return xxhash.xxh3_64_intdigest(array("I", tokens).tobytes(), seed=prev)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions
        self.group = 0  # the KV group whose prefix cache finds it (engine/kv_groups.py)


class BlockManager:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens, shared by the KV groups (``windows``: one
    per group, None for full attention; engine/kv_groups.py).

    Full blocks whose K/V has been computed are registered under their chained
    hash (per group). A new sequence reuses every leading full block whose hash and tokens
    match. Freed blocks keep their hash and stay findable until the pool hands
    them out again (least recently freed first). In a sliding-window group a sequence holds only the blocks
    its next queries read: the rest go back to the pool as it advances (``slide``).

    A hybrid model's pool (``state_pages``) is pages of which a sequence's linear-attention states take a row
    (engine/state_pages.py): its blocks never cached are handed out highest page first, before cached ones.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), state_pages: StatePages | None = None) -> None:
        self.num_blocks = num_blocks if state_pages is None else num_blocks - state_pages.reserved
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.has_windows = any(w is not None for w in self.windows)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.state_rows = StateRows(state_pages) if state_pages is not None else None
        self.fresh: FreshPages | None = None
        self.row_cost = 0  # KV pages a new sequence's state row takes out of the pool
        if state_pages is None:
            self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        else:  # free_ids: the cached free blocks alone
            self.free_ids = OrderedDict()
            lo, hi = (state_pages.seq_rows * state_pages.row_pages if state_pages.shared else 0,
                      state_pages.rows * state_pages.row_pages)
            self.fresh = FreshPages(num_blocks, (p for p in range(num_blocks) if not lo <= p < hi))
            self.row_cost = state_pages.row_pages if state_pages.shared else 0
        self.hash_maps: list[dict[int, int]] = [{} for _ in self.windows]
        self.hash_to_block = self.hash_maps[0]
        self.free_rows: list[int] = []  # rows of the runner's block tables (engine/block_tables.py) now unused
        self.freed_rows: list[int] = []  # rows given back since the last step plan took them (PlanBuilder)
        self.num_rows = 0
        self._table_ids = itertools.count(1)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + (len(self.fresh) if self.fresh is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _take_free(self, group: int = 0) -> int:
        if self.fresh:
            block_id = self.fresh.pop()
        else:
            block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)
        block.ref_count = 1
        block.group = group
        if self.state_rows is not None:
            self.state_rows.kv_taken(block_id)
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.hash_maps[block.group].get(block.hash) == block.block_id:
            del self.hash_maps[block.group][block.hash]
        block.hash = None
        block.token_ids = None

    def _revive(self, block_id: int) -> None:
        """A free cached block taken by a prefix hit."""
        del self.free_ids[block_id]
        if self.state_rows is not None:
            self.state_rows.kv_taken(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if self.fresh is not None and block.hash is None:
                self.fresh.add(block_id)
            else:
                self.free_ids[block_id] = None
            if self.state_rows is not None:
                self.state_rows.kv_freed(block_id)

    def _take_row(self) -> int:
        """A block-table row for a sequence starting (a hybrid's: the lowest claimable one, its pages out of the
        pool, evicting cached blocks there)."""
        if self.state_rows is not None:
            row = self.state_rows.claimable()[0]
            for page in self.state_rows.claim(row):
                if page in self.fresh:
                    self.fresh.remove(page)
                else:
                    del self.free_ids[page]
                    self._forget(self.blocks[page])
            return row
        if self.free_rows:
            return self.free_rows.pop()
        self.num_rows += 1
        return self.num_rows - 1

    def _give_row(self, row: int) -> None:
        if self.state_rows is not None:
            for page in self.state_rows.release(row):
                self.fresh.add(page)
        else:
            self.free_rows.append(row)
        self.freed_rows.append(row)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: each run starts cold). Only while no sequence holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            raise RuntimeError("reset_prefix_cache: some sequence still holds blocks")
        for hashes in self.hash_maps:
            hashes.clear()
        for block in self.blocks:
            block.hash = block.token_ids = None

    # -- prefill ---------------------------------------------------------------
    def can_allocate(self, seq: Sequence, budget: int | None = None) -> bool:
        """Whether ``allocate(seq, budget)`` finds its blocks, counting no prefix hit: a full group's for the
        whole prompt, a window group's for its window and one block (its first chunk may be cut short); a hybrid
        model's also a state row."""
        if self.state_rows is not None and not self.state_rows.claimable():
            return False
        return self.num_free_blocks - self.row_cost >= self._admission_blocks(seq)

    def admissible(self, seqs: Iterable[Sequence], limit: int) -> int:
        """How many of the first ``limit`` of ``seqs``, in order, ``can_allocate`` would let start together."""
        if self.state_rows is not None:
            limit = min(limit, len(self.state_rows.claimable(limit)))
        left, count = self.num_free_blocks, 0
        for seq in itertools.islice(seqs, limit):
            left -= self._admission_blocks(seq) + self.row_cost
            if left < 0:
                break
            count += 1
        return count

    def _admission_blocks(self, seq: Sequence) -> int:
        if not self.has_windows:
            return seq.num_blocks * self.num_groups
        return blocks_needed(seq.num_tokens, self.windows, self.block_size, self.block_size)

    def cached_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of ``seq`` the prefix cache holds (in every KV group that needs them) and
        ``seq`` may take (``hit_limit``)."""
        return len(self._find_hits(seq, self.hit_limit(seq))[1])

    def hit_limit(self, seq: Sequence, limit: int | None = None) -> int | None:
        """At most ``limit`` blocks, and no more than ``seq``'s settings let the cache serve (the positions
        whose logits give its prompt logprobs are computed: SamplingParams.max_cached_prompt_tokens)."""
        tokens = seq.params.max_cached_prompt_tokens
        if tokens is None:
            return limit
        return tokens // self.block_size if limit is None else min(limit, tokens // self.block_size)

    def allocate(self, seq: Sequence, budget: int | None = None, max_cached_blocks: int | None = None) -> int:
        """Give ``seq`` blocks for its tokens (a window group: for its first chunk of at most ``budget``
        tokens, as far as the free blocks reach; ``grow`` adds the next chunks'), at most ``max_cached_blocks``
        of them from the prefix cache (a hybrid model's hit ends at its deepest state snapshot); returns how
        many tokens came from the prefix cache."""
        assert not seq.block_table, "sequence already holds blocks"
        seq.table_row = self._take_row()
        seq.table_id = next(self._table_ids)
        seq.decode_until = 0
        bs = self.block_size
        # Prompt logprobs need the logits of the positions before the tokens they score: such a request takes
        # no more blocks than end before the first of them (all of the prompt's without prompt_logprobs_start).
        hits, hashes = [], []
        if self.enable_prefix_caching and seq.params.reads_prefix_cache:
            hits, hashes = self._find_hits(seq, self.hit_limit(seq, max_cached_blocks))
        depth = len(hashes)
        cached = depth * bs
        seq.block_tables = [[] for _ in self.windows]
        seq.held_from = [window_start_block(cached, w, bs) for w in self.windows]
        seq.slide_at = 0
        for g, window in enumerate(self.windows):
            table, lo = seq.block_tables[g], seq.held_from[g]
            for i in range(depth):
                if i < lo:
                    table.append(NULL_BLOCK)
                    continue
                block_id = hits[i][g]
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    self._revive(block_id)
                block.ref_count += 1
                table.append(block_id)
            if window is None:
                for _ in range(depth, seq.num_blocks):
                    table.append(self._take_free(g))
        end = seq.num_tokens if budget is None else min(seq.num_tokens, cached + max(budget, 1))
        self.grow(seq, end)
        if depth:
            seq.num_hashed_blocks, seq.last_block_hash = depth, hashes[-1]
        seq.num_cached_tokens = seq.num_computed_tokens = cached
        return cached

    def _find_hits(self, seq: Sequence, limit: int | None = None) -> tuple[list[list[int]], list[int]]:
        """The deepest prefix hit (of at most ``limit`` blocks): per block of it, its id in each group, and the
        blocks' chained hashes.

        A full group needs every block of the hit, a window group only those the first query after it reads."""
        bs, groups = self.block_size, range(self.num_groups)
        found: list[list[int | None]] = []
        hashes: list[int] = []
        prev = 0
        full = [g for g in groups if self.windows[g] is None]
        # A block holding the last token is never reused: one token must be computed to sample from.
        for i in range(seq.num_blocks if limit is None else min(seq.num_blocks, limit)):
            if (i + 1) * bs >= seq.num_tokens:
                break
            tokens = seq.block_tokens(i)
            h = chain_hash(prev, tokens)
            row: list[int | None] = []
            for g in groups:
                block_id = self.hash_maps[g].get(h)
                ok = block_id is not None and self.blocks[block_id].token_ids == tuple(tokens)
                row.append(block_id if ok else None)
            if any(row[g] is None for g in full) or (not self.has_windows and row[0] is None):
                break  # a full group's hit ends here
            found.append(row)
            hashes.append(h)
            prev = h
        depth = len(found)
        while depth:
            if all(found[i][g] is not None for g in groups
                   for i in range(window_start_block(depth * bs, self.windows[g], bs), depth)):
                break
            depth -= 1
        return found[:depth], hashes[:depth]  # type: ignore[return-value]

    def grow(self, seq: Sequence, end: int) -> int:
        """Window groups' blocks up to token ``end`` (a prefill chunk's end; full groups hold the whole prompt
        from ``allocate``); returns the end the free blocks reach (``end``, or less when the pool is short)."""
        if not self.has_windows:
            return end
        bs = self.block_size
        lacking = [(g, -(-end // bs) - len(seq.block_tables[g])) for g in range(self.num_groups)]
        lacking = [(g, n) for g, n in lacking if n > 0]
        if not lacking:
            return end
        per_group = min(max(n for _, n in lacking), self.num_free_blocks // len(lacking))
        for g, n in lacking:
            for _ in range(min(n, per_group)):
                seq.block_tables[g].append(self._take_free(g))
        return min(end, min(len(seq.block_tables[g]) for g, _ in lacking) * bs)

    def slide(self, seq: Sequence) -> None:
        """Give back the window groups' blocks that no query from ``num_computed_tokens`` on reads."""
        bs, start = self.block_size, seq.num_computed_tokens
        due = None
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table, lo = seq.block_tables[g], seq.held_from[g]
            upto = min(window_start_block(start, window, bs), len(table))
            if upto > lo:
                for i in range(lo, upto):
                    self._release(table[i])
                    table[i] = NULL_BLOCK
                seq.held_from[g] = lo = upto
            # the computed count at which this group's next block falls out of the window
            at = (lo + 1) * bs + window - 1
            due = at if due is None or at < due else due
        seq.slide_at = due if due is not None else 1 << 62

    def register_computed(self, seq: Sequence, upto: int | None = None) -> None:
        """Publish the full blocks whose K/V is (being) computed and whose tokens are all known: those of the
        first ``upto`` tokens (default: ``num_computed_tokens``)."""
        if not self.enable_prefix_caching:
            return
        end = seq.num_computed_tokens if upto is None else upto
        for i in range(seq.num_hashed_blocks, end // self.block_size):
            tokens = seq.block_tokens(i)
            if PENDING_TOKEN in tokens:
                break  # its last token is still on the device; registered once it is read back
            h = chain_hash(seq.last_block_hash, tokens)
            key = tuple(tokens)
            for g, table in enumerate(seq.block_tables):
                block_id = table[i]
                if block_id == NULL_BLOCK:  # released before its tokens were known: not findable
                    continue
                block = self.blocks[block_id]
                block.hash, block.token_ids = h, key
                self.hash_maps[g][h] = block_id
            seq.num_hashed_blocks, seq.last_block_hash = i + 1, h

    # -- decode ----------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= self._blocks_short(seq) * self.num_groups

    def append_slot(self, seq: Sequence) -> None:
        for g in range(self.num_groups):
            table = seq.block_tables[g]
            for _ in range(max(0, seq.num_blocks - len(table))):
                table.append(self._take_free(g))

    def _blocks_short(self, seq: Sequence) -> int:
        return max(0, seq.num_blocks - len(seq.block_table))

    # -- release ---------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; its computed K/V is forgotten (recompute on re-admission)."""
        for table in seq.block_tables:
            for block_id in reversed(table):  # tail first, so the shared prefix is evicted last
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables = [[] for _ in self.windows]
        seq.held_from = [0] * self.num_groups
        seq.decode_until = 0
        if seq.table_row >= 0:
            self._give_row(seq.table_row)
            seq.table_row = -1
        seq.num_hashed_blocks = seq.last_block_hash = 0
        seq.num_computed_tokens = 0
