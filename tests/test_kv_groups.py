"""KV groups (engine/kv_groups.py) and the block manager's sliding-window rules: how layers are grouped (layers of
two KV shapes, Gemma 4's, in one slab per block id), which blocks a window group gives back as a sequence
advances, and which prefix hits a window group allows."""
from __future__ import annotations

import pytest

from llmcli.engine.block_manager import BlockManager
from llmcli.engine.kv_groups import (
    MAX_MIXED_GROUPS, NULL_BLOCK, blocks_held, plan_kv_groups, plan_mixed_kv_groups,
)
from llmcli.engine.sequence import Sequence
from llmcli.sampling_params import SamplingParams

BS = 4
W = 6  # keys a query sees: positions p - 5 .. p


def gemma_windows(layers: int, window: int = 1024) -> list[int | None]:
    """Gemma 3's pattern: every sixth layer global."""
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def test_one_kind_is_one_group():
    assert plan_kv_groups([None] * 28).windows == (None,)
    mistral = plan_kv_groups([4096] * 32, max_model_len=32768)
    assert mistral.windows == (4096,) and mistral.slots == 32
    # a window no shorter than max_model_len never cuts anything: plain full attention
    assert plan_kv_groups([4096] * 32, max_model_len=4096).windows == (None,)


@pytest.mark.parametrize("layers, slots, groups", [(48, 8, 6), (62, 13, 5), (26, 4, 7), (3, 1, 3)])
def test_mixed_kinds_split_into_groups_of_equal_size(layers, slots, groups):
    windows = gemma_windows(layers) if layers > 3 else [24, None, 24]
    layout = plan_kv_groups(windows)
    assert (layout.slots, layout.num_groups) == (slots, groups)
    assert layout.windows[0] is None  # full first
    seen = sorted(i for group in layout.layers for i in group)
    assert seen == list(range(layers))  # every layer in exactly one group
    for window, group in zip(layout.windows, layout.layers):
        assert len(group) <= slots and all(windows[i] == window for i in group)


def test_release_switch_lays_a_windowed_model_out_as_full_attention(monkeypatch):
    monkeypatch.setenv("LLMCLI_KV_WINDOW_RELEASE", "0")
    assert plan_kv_groups(gemma_windows(12)).windows == (None,)
    assert plan_kv_groups([24] * 4).windows == (None,)


def seq_of(n: int, start: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=8), BS)


def run_prefill(manager: BlockManager, seq: Sequence, chunk: int) -> list[int]:
    """Chunk by chunk as the scheduler does (grow, compute, register, slide); the blocks held after each."""
    assert manager.can_allocate(seq, chunk)
    manager.allocate(seq, chunk)
    held = []
    while seq.num_computed_tokens < seq.num_tokens:
        start = seq.num_computed_tokens
        end = manager.grow(seq, min(seq.num_tokens, start + chunk))
        assert end > start
        seq.num_computed_tokens = end
        manager.register_computed(seq)
        manager.slide(seq)
        held.append(sum(b != NULL_BLOCK for table in seq.block_tables for b in table))
    return held


def test_window_blocks_go_back_as_a_chunked_prompt_advances():
    manager = BlockManager(64, BS, windows=(W,))
    seq = seq_of(40)
    held = run_prefill(manager, seq, chunk=5)
    # never more than the window's blocks and a chunk's (the admission rule's bound)
    assert max(held) <= blocks_held(40, W, BS, 5) < 10
    table = seq.block_table
    # the next query (position 40) sees keys 35..39: blocks 8 and 9; everything before is back in the pool
    assert table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:]
    assert manager.num_free_blocks == 64 - 2
    manager.free(seq)
    assert manager.num_free_blocks == 64


def test_full_group_keeps_every_block_beside_a_window_group():
    manager = BlockManager(64, BS, windows=(None, W))
    seq = seq_of(40)
    run_prefill(manager, seq, chunk=8)
    full, window = seq.block_tables
    assert NULL_BLOCK not in full and len(full) == 10
    assert window[:8] == [NULL_BLOCK] * 8
    assert manager.num_free_blocks == 64 - 10 - 2


def test_a_long_window_sequence_fits_a_pool_its_full_length_would_not():
    manager = BlockManager(6, BS, windows=(W,))
    seq = seq_of(60)  # 15 blocks of full attention
    assert max(run_prefill(manager, seq, chunk=4)) <= 6
    assert BlockManager(6, BS).can_allocate(seq_of(60)) is False


def prompt_then_eight_blocks_of_another(manager: BlockManager) -> Sequence:
    """A 41-token prompt computed and finished, then a 32-token one of other tokens (taking the first eight
    blocks the pool hands out, which forgets their hashes) finished too; the first prompt again, unallocated."""
    first = seq_of(41)
    run_prefill(manager, first, chunk=41)
    manager.free(first)
    taker = seq_of(8 * BS, start=1000)
    run_prefill(manager, taker, chunk=8 * BS)
    manager.free(taker)
    return seq_of(41)


def test_hit_deeper_than_the_window_needs_only_the_window_blocks():
    manager = BlockManager(11, BS, windows=(W,))
    # blocks 0..7 went back first (released as the prompt passed them) and are the first the pool hands out
    again = prompt_then_eight_blocks_of_another(manager)
    hit = manager.allocate(again, 41)
    # the query at 40 reads only blocks 8 and 9 (keys 35..39), still cached: a 40-token hit
    assert hit == 40
    assert again.block_table[:8] == [NULL_BLOCK] * 8
    # as full attention, the same pool and the same sequences leave only a 12-token prefix: a full group frees
    # tail first (the prefix is evicted last) and needs every block up to the hit
    full = BlockManager(11, BS)
    first = seq_of(41)
    full.allocate(first)
    first.num_computed_tokens = 41
    full.register_computed(first)
    full.free(first)
    taker = seq_of(8 * BS, start=1000)
    full.allocate(taker)
    full.free(taker)
    assert full.allocate(seq_of(41)) == 3 * BS


def test_a_window_group_limits_the_hit_of_a_full_group():
    manager = BlockManager(22, BS, windows=(None, W))
    # the pool hands out the window group's released early blocks first, then the full group's blocks tail
    # first: the 32-token sequence takes window blocks 0..7 and full blocks 10..3 of the first prompt
    again = prompt_then_eight_blocks_of_another(manager)
    # the full group still has blocks 0..2, but a query at 4, 8 or 12 reads window blocks that are gone
    assert manager.allocate(again, 41) == 0
    free_before = manager.num_free_blocks
    manager.free(again)
    assert manager.num_free_blocks > free_before


def test_a_snapshot_limit_caps_the_hit_and_the_window_is_checked_at_the_shallower_depth():
    """A hybrid model's hit ends at its deepest state snapshot (``max_cached_blocks``): the hit is the smaller
    of that and the KV groups' depth, and a window group must still hold the blocks the first query after the
    shallower hit reads."""
    full = BlockManager(64, BS)
    first = seq_of(41)
    run_prefill(full, first, chunk=41)
    full.free(first)
    assert full.cached_blocks(seq_of(41)) == 10
    assert full.allocate(seq_of(41), max_cached_blocks=3) == 3 * BS
    manager = BlockManager(11, BS, windows=(W,))
    again = prompt_then_eight_blocks_of_another(manager)  # blocks 0..7 gone, 8 and 9 cached
    assert manager.cached_blocks(again) == 10
    # cut to 5 blocks, the query at 20 would read blocks 3 and 4, which are gone: no hit at all
    assert manager.allocate(again, 41, max_cached_blocks=5) == 0


def test_an_evicted_block_inside_the_window_makes_the_hit_shallower():
    manager = BlockManager(64, BS, windows=(W,))
    first = seq_of(41)
    run_prefill(manager, first, chunk=41)
    # drop block 9 from the prefix cache (as if its id went to another sequence)
    table = first.block_table
    manager.free(first)
    block = manager.blocks[table[9]]
    del manager.hash_maps[0][block.hash]
    again = seq_of(41)
    hit = manager.allocate(again, 41)
    # depth 10 needs blocks 8-9, depth 9 needs 7-8 (keys 31..35): present
    assert hit == 9 * BS


def test_freed_window_blocks_are_counted_free_and_reused_by_others():
    manager = BlockManager(8, BS, windows=(W,))
    a = seq_of(40)
    run_prefill(manager, a, chunk=4)
    b = seq_of(20, start=500)
    assert manager.can_allocate(b, 4)
    run_prefill(manager, b, chunk=4)
    held = {x for x in a.block_table + b.block_table if x != NULL_BLOCK}
    assert len(held) == 4  # two window blocks each, none shared


def published_gemma4(name: str) -> tuple[list[int | None], list[int]]:
    """Per attention layer of a published Gemma 4 config: its window (None: global) and K + V elements per token."""
    from pathlib import Path

    from llmcli.models.gemma4 import Gemma4ForCausalLM
    from llmcli.models.hub import load_hf_config

    spec = Gemma4ForCausalLM.spec(load_hf_config(Path(__file__).resolve().parent.parent / "configs" / name))
    kinds = [spec.layer_kind(i) for i in range(spec.num_layers)]
    sizes = [2 * spec.attention_shape(kind)[0] * spec.attention_shape(kind)[1] for kind in kinds]
    return [None if kind == "full_attention" else spec.sliding_window for kind in kinds], sizes


def test_gemma4_layers_of_two_sizes_fill_one_slab_per_block_id(monkeypatch):
    """Gemma-4-31B: 50 local layers of 16 x 256 and 10 global ones of 4 x 512 (half the bytes). A block id is a
    slab of five local layers' K and V: ten window groups of five, and the ten global layers side by side in the
    eleventh; no group wastes any of it. With release off: one group, the slab every layer's."""
    windows, sizes = published_gemma4("gemma-4-31B")
    layout = plan_mixed_kv_groups(windows, sizes, max_model_len=32768)
    assert layout.windows == (None,) + (1024,) * 10
    assert [len(group) for group in layout.layers] == [10] + [5] * 10
    assert layout.slab == 5 * 2 * 16 * 256 == 10 * 2 * 4 * 512
    for window, group in zip(layout.windows, layout.layers):
        assert all(windows[i] == window for i in group)
        # side by side from the slab's start, none past its end
        spans = sorted((layout.offsets[i], layout.offsets[i] + sizes[i]) for i in group)
        assert spans[0][0] == 0 and spans[-1][1] == layout.slab
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert sorted(i for group in layout.layers for i in group) == list(range(60))
    # 26B-A4B's 25 local layers do not split evenly: the plan still holds the least per long sequence
    windows, sizes = published_gemma4("gemma-4-26B-A4B")
    layout = plan_mixed_kv_groups(windows, sizes, max_model_len=32768)
    global_bytes = sum(s for s, w in zip(sizes, windows) if w is None)
    assert layout.num_groups <= MAX_MIXED_GROUPS and layout.slab < 2 * global_bytes
    monkeypatch.setenv("LLMCLI_KV_WINDOW_RELEASE", "0")
    off = plan_mixed_kv_groups(windows, sizes, max_model_len=32768)
    assert off.windows == (None,) and off.slab == sum(sizes)


def test_layers_of_two_shapes_share_a_block_id_without_overwriting_each_other():
    """The pool for layers of two KV shapes: each layer's K and V are views of its own shape into a block id's
    slab; the layers of one group never overlap there, and every view stays inside the pool."""
    import torch
    from torch import nn

    from llmcli.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token, kv_layout
    from llmcli.layers.attention import Attention

    # local 4 x 16 with a 24-key window, global 1 x 32: two local groups, the two global layers in the third
    model = nn.ModuleList([Attention(4, 4, 16, None, 24), Attention(4, 1, 32, None),
                           Attention(4, 4, 16, None, 24), Attention(4, 1, 32, None)])
    layout = kv_layout(model, max_model_len=192)
    assert layout.windows == (None, 24, 24) and layout.slab == 2 * 4 * 16
    assert kv_bytes_per_token(None, 4, 16, torch.float32, model, layout) == 2 * 4 * 16 * 4
    cache = allocate_kv_cache(model, 5, BS, 4, 16, torch.float32, torch.device("cpu"), layout)
    assert cache.numel() == 5 * BS * layout.slab
    start, end = cache.data_ptr(), cache.data_ptr() + cache.numel() * 4
    for layer in model:
        assert layer.k_cache.shape == (5, BS, layer.num_kv_heads, layer.head_dim)
        assert layer.k_cache.stride(0) == BS * layout.slab
    for g, group in enumerate(layout.layers):
        assert all(model[i].kv_group == g for i in group)
        for n, i in enumerate(group):  # block 3, as group g would hold it
            model[i].k_cache[3] = 10 * n + 1
            model[i].v_cache[3] = 10 * n + 2
        for n, i in enumerate(group):
            assert bool((model[i].k_cache[3] == 10 * n + 1).all()) and bool((model[i].v_cache[3] == 10 * n + 2).all())
    for layer in model:
        for view in (layer.k_cache, layer.v_cache):
            last = view[-1, -1, -1, -1]
            assert start <= view.data_ptr() and last.data_ptr() + 4 <= end
