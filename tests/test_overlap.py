"""The overlapped step loop (tokens read back one step late) against the synchronous one.

The synchronous loop is itself checked against transformers in test_engine_vs_hf;
here both loops must give identical outputs where sequences stop early (EOS,
stop tokens, stop strings), at length limits, and under preemption, and leave the
pool empty.
"""
from __future__ import annotations

import random

import pytest

from llmcli import LLM, SamplingParams


def _run(model, overlap: bool, prompts, params, **knobs):
    llm = LLM(str(model), device="cpu", dtype="float32", kvcache_block_size=16, **knobs)
    llm.engine.overlap = overlap
    try:
        outs = llm.generate(prompts, params)
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert all(b.ref_count == 0 for b in bm.blocks)
        assert llm.engine.inflight is None
        return [(o.token_ids, o.finish_reason, o.text, o.stop_reason) for o in outs], llm.engine.stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("blocks", [512, 14])
def test_overlap_matches_synchronous_loop(tiny_model, blocks):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 600) for _ in range(rng.randint(1, 90))] for _ in range(10)]
    sync, _ = _run(tiny_model, False, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   num_kvcache_blocks=blocks, max_num_batched_tokens=64)
    # stop on tokens the greedy runs are known to produce, at different depths
    params = []
    for i, (tokens, _, _, _) in enumerate(sync):
        stop = [tokens[3 + i]] if i % 3 == 0 else None
        params.append(SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=10 + 3 * i,
                                     ignore_eos=i % 4 != 1, stop_token_ids=stop))
    a, stats_a = _run(tiny_model, False, prompts, params, num_kvcache_blocks=blocks, max_num_batched_tokens=64)
    b, stats_b = _run(tiny_model, True, prompts, params, num_kvcache_blocks=blocks, max_num_batched_tokens=64)
    assert a == b
    assert any(reason == "stop" for _, reason, _, _ in a) and any(reason == "length" for _, reason, _, _ in a)
    if blocks == 14:
        assert stats_b.num_preemptions > 0


def test_overlap_stop_strings(tiny_model):
    prompts = ["The quick brown fox", "In the morning the market", "Numbers like"]
    base = LLM(str(tiny_model), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128)
    texts = [o.text for o in base.generate(prompts, SamplingParams(temperature=0, max_tokens=30))]
    base.shutdown()
    stops = [t[len(t) // 2: len(t) // 2 + 2] for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=30, stop=[s]) for s in stops]
    a, _ = _run(tiny_model, False, prompts, params, num_kvcache_blocks=128)
    b, _ = _run(tiny_model, True, prompts, params, num_kvcache_blocks=128)
    assert a == b
    for (tokens, reason, text, stop), s in zip(b, stops):
        assert reason == "stop" and stop == s and s not in text
