"""KV groups: the attention layers of one kind (full, or one sliding window) share a block table per sequence.

A model whose attention layers are all of one kind is one group (today's layout: one table per sequence).
Gemma 3 (local and global layers) has both kinds. One pool of block ids serves every group, so the memory a
window gives back goes to whichever group needs it next: a block id stands for the same number of bytes in
every group. To make that so, each kind's layers are cut into groups of at most ``slots`` layers (the cut that
wastes the fewest layer slots, at most ``MAX_GROUPS`` groups), and the cache holds ``slots`` layer tensors of
``num_blocks`` blocks: layer ``j`` of every group uses tensor ``j``, at the block ids its group's table names.

The release rule, per sliding-window group: the next step's first query is at the sequence's computed count
``c`` (a decode token, or a prefill chunk's start), and it sees keys from ``c - W + 1`` on; every block wholly
before that (``window_start_block``) goes back to the pool, its table entry becomes ``NULL_BLOCK``, and the
kernels (which read no key before a query's window) never look at it. A released block keeps its prefix hash
and stays findable, like any freed block. A prefix hit of depth ``d`` blocks needs, in a window group, only
the blocks the first computed query sees (``window_start_block(d * block_size) .. d``), and all ``d`` in a
full group.

Layers of different KV shapes (Gemma 4: 256-wide local heads, 512-wide global ones with fewer KV heads) are
planned by size instead (``plan_mixed_kv_groups``): a block id is a slab of ``slab`` elements per token, and the
layers of one group lie side by side in it (``offsets``), each viewed with its own shape; a group of the smaller
layers packs more of them into the slab, so that no group wastes much of it.

``LLMCLI_KV_WINDOW_RELEASE=0`` lays a windowed model out as full attention (one group, nothing released): the
kernels still apply the windows; only the memory stays held (for comparisons).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

MAX_GROUPS = 8
# Layers of several sizes fill a slab exactly only with more groups (Gemma 4 31B: ten groups of five local layers
# and one of its ten half-size global layers); each group costs a block table and a slot mapping per step
MAX_MIXED_GROUPS = 12
NULL_BLOCK = -1  # a released window block's table entry on the scheduler side (the runner's table keeps a valid id)


@dataclass(frozen=True)
class KVLayout:
    """Which attention layer belongs to which group, and the cache's layer tensors (``slots``)."""

    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layers: tuple[tuple[int, ...], ...]  # per group: its attention layers (indices in model order)
    slots: int  # layer tensors in the cache; layer j of a group uses tensor j
    # layers of several KV shapes (plan_mixed_kv_groups): per attention layer (model order) where its K starts in
    # a block's slab, in elements per token (its V follows K), and the slab's elements per token; empty and 0
    # where every layer has one shape (the ``slots`` layer tensors above)
    offsets: tuple[int, ...] = ()
    slab: int = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def group_of(self) -> list[tuple[int, int]]:
        """Per attention layer (model order): (its group, its tensor)."""
        where: dict[int, tuple[int, int]] = {}
        for g, layers in enumerate(self.layers):
            for j, layer in enumerate(layers):
                where[layer] = (g, j)
        return [where[i] for i in range(len(where))]


def release_enabled() -> bool:
    return os.environ.get("LLMCLI_KV_WINDOW_RELEASE", "1") != "0"


def _window_kinds(windows: Sequence[int | None], max_model_len: int | None
                  ) -> tuple[list[int | None], list[int | None], int | None | bool]:
    """The windows (one no shorter than ``max_model_len`` releases nothing: full), their distinct kinds full first,
    and the one kind every layer is laid out as when there is no more than one (None: full, also with release
    off), or False when the kinds make several groups."""
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if len(kinds) <= 1 or not release_enabled():
        return list(windows), kinds, kinds[0] if len(kinds) == 1 and release_enabled() else None
    return list(windows), kinds, False


def plan_kv_groups(windows: Sequence[int | None], max_model_len: int | None = None) -> KVLayout:
    """Groups for attention layers with these windows (None: full). A window no shorter than ``max_model_len``
    never releases a block, so such layers count as full."""
    n = len(windows)
    windows, kinds, single = _window_kinds(windows, max_model_len)
    if single is not False:
        return KVLayout((single,), (tuple(range(n)),), max(n, 1))
    members = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    counts = [len(members[kind]) for kind in kinds]
    best: tuple[int, int, int] | None = None  # (wasted slots, groups, slots)
    for size in range(1, max(counts) + 1):
        groups = sum(-(-c // size) for c in counts)
        if groups > MAX_GROUPS:
            continue
        key = (groups * size - n, groups, size)
        if best is None or key < best:
            best = key
    assert best is not None  # size = max(counts) gives one group per kind, and kinds are few
    size = best[2]
    out_windows: list[int | None] = []
    out_layers: list[tuple[int, ...]] = []
    for kind in kinds:
        layers = members[kind]
        for lo in range(0, len(layers), size):
            out_windows.append(kind)
            out_layers.append(tuple(layers[lo:lo + size]))
    return KVLayout(tuple(out_windows), tuple(out_layers), size)


def plan_mixed_kv_groups(windows: Sequence[int | None], sizes: Sequence[int],
                         max_model_len: int | None = None) -> KVLayout:
    """Groups for attention layers of different KV sizes (``sizes``: each layer's K and V elements per token).

    Each kind's layers are cut, in order, into groups of at most ``slab`` elements per token; of the slabs that
    give at most ``MAX_MIXED_GROUPS`` groups, the one whose sequence of ``max_model_len`` tokens holds the fewest
    bytes (a full group's blocks for every token, a window group's for its window; without ``max_model_len``:
    the fewest wasted elements), then the fewest groups."""
    n = len(windows)
    windows, kinds, single = _window_kinds(windows, max_model_len)
    if single is not False:
        return _packed([single], [list(range(n))], sizes, sum(sizes))
    members = [[i for i, w in enumerate(windows) if w == kind] for kind in kinds]
    candidates = set()
    for layers in members:  # a greedy cut changes only where the slab equals some run of a kind's layers
        for lo in range(len(layers)):
            total = 0
            for i in layers[lo:]:
                total += sizes[i]
                candidates.add(total)
    best: tuple[tuple[int, int, int], list[int | None], list[list[int]]] | None = None
    for slab in sorted(c for c in candidates if c >= max(sizes)):
        out_windows: list[int | None] = []
        out_layers: list[list[int]] = []
        for kind, layers in zip(kinds, members):
            for group in _cut(layers, sizes, slab):
                out_windows.append(kind)
                out_layers.append(group)
        if len(out_layers) > MAX_MIXED_GROUPS:
            continue
        tokens = [1 if max_model_len is None else max_model_len if w is None else min(w, max_model_len)
                  for w in out_windows]
        key = (slab * sum(tokens), len(out_layers), slab)
        if best is None or key < best[0]:
            best = (key, out_windows, out_layers)
    if best is None:  # more kinds than groups allowed: every layer as full attention, nothing released
        return _packed([None], [list(range(n))], sizes, sum(sizes))
    _, out_windows, out_layers = best
    return _packed(out_windows, out_layers, sizes, best[0][2])


def _cut(layers: list[int], sizes: Sequence[int], slab: int) -> list[list[int]]:
    """``layers`` in order, in runs of at most ``slab`` elements per token."""
    groups: list[list[int]] = [[]]
    used = 0
    for i in layers:
        if used + sizes[i] > slab:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += sizes[i]
    return groups


def _packed(windows: list[int | None], groups: list[list[int]], sizes: Sequence[int], slab: int) -> KVLayout:
    offsets = [0] * len(sizes)
    for group in groups:
        at = 0
        for i in group:
            offsets[i], at = at, at + sizes[i]
    return KVLayout(tuple(windows), tuple(tuple(g) for g in groups), max(len(g) for g in groups),
                    tuple(offsets), slab)


def kv_windows_of(report: object) -> tuple[int | None, ...]:
    """The KV groups' windows from a runner's ``MemoryReport`` (one full group where it names none)."""
    groups = getattr(report, "kv_groups", None) or ()
    return tuple(g["window"] for g in groups) or (None,)


def window_start_block(position: int, window: int | None, block_size: int) -> int:
    """The first block the query at ``position`` reads (0 without a window): every block before it may go."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def blocks_held(length: int, window: int | None, block_size: int, chunk: int = 1) -> int:
    """The most blocks a sequence of ``length`` tokens holds at once in a group with this window, computed in
    chunks of at most ``chunk`` tokens (a decode step is a chunk of one; a prefill chunk is cut to what the
    pool has free, down to one block)."""
    total = -(-length // block_size)
    if window is None:
        return total
    # the blocks under a chunk's first query's window, the chunk's own, and one more for misalignment
    return min(total, -(-(window - 1 + chunk) // block_size) + 1)


def blocks_needed(length: int, windows: Sequence[int | None], block_size: int, chunk: int) -> int:
    """Over every group: the blocks a sequence of ``length`` tokens may hold at once (with ``chunk`` =
    ``block_size``: what it needs to advance one block at a time, the admission rule)."""
    return sum(blocks_held(length, w, block_size, chunk) for w in windows)
