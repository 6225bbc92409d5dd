"""BlockManager: where each sequence's K/V lives in the fixed pool, with prefix sharing."""
from __future__ import annotations

from array import array
import itertools
from collections import OrderedDict

import xxhash

from llmcli.engine.sequence import PENDING_TOKEN, Sequence


def chain_hash(prev: int, tokens: list[int]) -> int:
    """Hash of a block that also covers every block before it (through ``prev``)."""
    return xxhash.xxh3_64_intdigest(array("I", tokens).tobytes(), seed=prev)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions


class BlockManager:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens.

    Full blocks whose K/V has been computed are registered under their chained
    hash. A new sequence reuses every leading full block whose hash and tokens
    match. Freed blocks keep their hash and stay findable until the pool hands
    them out again (least recently freed first).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.free_rows: list[int] = []  # rows of the runner's block tables (engine/block_tables.py) now unused
        self.freed_rows: list[int] = []  # rows given back since the last step plan took them (PlanBuilder)
        self.num_rows = 0
        self._table_ids = itertools.count(1)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def _take_free(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash = None
        block.token_ids = None
        block.ref_count = 1
        return block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: each run starts cold). Only while no sequence holds blocks."""
        if len(self.free_ids) != self.num_blocks:
            raise RuntimeError("reset_prefix_cache: some sequence still holds blocks")
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash = block.token_ids = None

    # -- prefill ---------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks

    def cached_blocks(self, seq: Sequence, hashes: list[int]) -> int:
        """How many leading blocks of ``seq`` (whose chained ``hashes`` are given) the prefix cache holds."""
        for i, h in enumerate(hashes):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                return i
        return len(hashes)

    def allocate(self, seq: Sequence, max_cached_blocks: int | None = None) -> int:
        """Give ``seq`` blocks for all its tokens, at most ``max_cached_blocks`` of them from the prefix cache
        (a hybrid model's hit ends at its deepest state snapshot); returns how many tokens came from the cache."""
        assert not seq.block_table, "sequence already holds blocks"
        if self.free_rows:
            seq.table_row = self.free_rows.pop()
        else:
            seq.table_row, self.num_rows = self.num_rows, self.num_rows + 1
        seq.table_id = next(self._table_ids)
        seq.decode_until = 0
        bs = self.block_size
        # Prompt logprobs need the logits of every prompt position: such a request computes its whole prompt,
        # as one that asks to skip the cache (skip_reading_prefix_cache) does.
        prev, cached = 0, 0
        hit_possible = self.enable_prefix_caching and seq.params.reads_prefix_cache
        for i in range(seq.num_blocks):
            # A block holding the last token is never reused: one token must be computed to sample from.
            if hit_possible and (i + 1) * bs < seq.num_tokens and (max_cached_blocks is None or i < max_cached_blocks):
                tokens = seq.block_tokens(i)
                h = chain_hash(prev, tokens)
                block_id = self.hash_to_block.get(h)
                if block_id is not None and self.blocks[block_id].token_ids == tuple(tokens):
                    block = self.blocks[block_id]
                    if block.ref_count == 0:
                        del self.free_ids[block_id]
                    block.ref_count += 1
                    seq.block_table.append(block_id)
                    seq.num_hashed_blocks, seq.last_block_hash = i + 1, h
                    prev, cached = h, cached + bs
                    continue
                hit_possible = False
            seq.block_table.append(self._take_free())
        seq.num_cached_tokens = seq.num_computed_tokens = cached
        return cached

    def register_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose K/V is (being) computed and whose tokens are all known."""
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // self.block_size):
            tokens = seq.block_tokens(i)
            if PENDING_TOKEN in tokens:
                break  # its last token is still on the device; registered once it is read back
            h = chain_hash(seq.last_block_hash, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tuple(tokens)
            self.hash_to_block[h] = block.block_id
            seq.num_hashed_blocks, seq.last_block_hash = i + 1, h

    # -- decode ----------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= self._blocks_short(seq)

    def append_slot(self, seq: Sequence) -> None:
        for _ in range(self._blocks_short(seq)):
            seq.block_table.append(self._take_free())

    def _blocks_short(self, seq: Sequence) -> int:
        return max(0, seq.num_blocks - len(seq.block_table))

    # -- release ---------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; its computed K/V is forgotten (recompute on re-admission)."""
        for block_id in reversed(seq.block_table):  # tail first, so the shared prefix is evicted last
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table = []
        seq.decode_until = 0
        if seq.table_row >= 0:
            self.free_rows.append(seq.table_row)
            self.freed_rows.append(seq.table_row)
            seq.table_row = -1
        seq.num_hashed_blocks = seq.last_block_hash = 0
        seq.num_computed_tokens = 0
