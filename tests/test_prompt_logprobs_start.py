"""``SamplingParams.prompt_logprobs_start`` (issue 42, scoring jobs): prompt logprobs from one position on, so
that the prefix cache may serve the prompt before it; requests added together that share a context hit each
other's blocks in the same run. Compared with a full computation with the prefix cache off, on the tiny fp32
model (tests/conftest.py), whose full prompt logprobs other tests check against transformers."""
from __future__ import annotations

import pytest
from test_hybrid_prefix_cache import hybrid  # noqa: F401  (the fixture: a tiny Qwen3.5 with a long memory)

from llmcli import SamplingParams
from llmcli.config import Config
from llmcli.engine.llm_engine import LLMEngine
from llmcli.sampling_params import SamplingParamsError

BS = 4  # small KV blocks: short contexts fill several, as a long one fills 64-token blocks
CONTEXT = [7, 19, 23, 42, 5, 88, 101, 64, 13, 250, 31, 77, 140, 9, 56, 200, 3, 99, 120, 45, 61, 180]  # 22 tokens
CHOICES = [[301, 17], [12, 333, 8], [44], [90, 91]]  # one question's continuations


def engine(model, caching: bool) -> LLMEngine:
    return LLMEngine(Config(model=str(model), device="cpu", dtype="float32", kvcache_block_size=BS,
                            num_kvcache_blocks=128, max_num_seqs=16, enable_prefix_caching=caching))


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Every request added at once, as lm-eval's backend and the command line add a question's choices."""
    for i, (ids, p) in enumerate(zip(prompts, params)):
        eng.add_request(ids, p, request_id=i)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out
    return [done[i] for i in range(len(prompts))]


def score(start: int | None = None, k: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k, prompt_logprobs_start=start)


@pytest.fixture(scope="module")
def full(tiny_model):
    """Every prompt position's logprobs, prefix cache off."""
    eng = engine(tiny_model, caching=False)
    try:
        yield lambda prompts: run(eng, prompts, [score()] * len(prompts))
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def cached_engine(tiny_model):
    eng = engine(tiny_model, caching=True)
    yield eng
    eng.shutdown()


def assert_same_from(got, want, start: int) -> None:
    """Positions before ``start`` are None; from it on, the same tokens, logprobs (1e-5) and ranks."""
    got, want = list(got), list(want)
    assert len(got) == len(want)
    assert got[:start] == [None] * start
    for j in range(max(start, 1), len(want)):
        assert list(got[j]) == list(want[j]), j
        for token, lp in want[j].items():
            assert got[j][token].logprob == pytest.approx(lp.logprob, abs=1e-5)
            assert got[j][token].rank == lp.rank


def test_choices_added_together_share_their_context_and_score_as_a_full_computation(cached_engine, full):
    cached_engine.scheduler.reset_prefix_cache()
    prompts = [CONTEXT + c for c in CHOICES]
    start = len(CONTEXT)
    outs = run(cached_engine, prompts, [score(start)] * len(prompts))
    # the first choice computes the context; the others, in the same step, take its full blocks up to the
    # position whose logits give the first continuation token (21 = start - 1: 5 blocks of 4)
    cached = [o.metrics.num_cached_prompt_tokens for o in outs]
    assert cached == [0] + [(start - 1) // BS * BS] * 3
    for out, want in zip(outs, full(prompts)):
        assert_same_from(out.prompt_logprobs, want.prompt_logprobs, start)


# position start - 1 (whose logits give token start) the last of a block, the first of the next, the second
@pytest.mark.parametrize("start", [8, 9, 10])
def test_a_hit_stops_where_the_first_wanted_logit_is(cached_engine, full, start):
    cached_engine.scheduler.reset_prefix_cache()
    prompt = CONTEXT + CHOICES[0]
    first, again = run(cached_engine, [prompt, prompt], [score(start)] * 2)
    assert first.metrics.num_cached_prompt_tokens == 0
    assert again.metrics.num_cached_prompt_tokens == (start - 1) // BS * BS  # 4, 8, 8
    (want,) = full([prompt])
    for out in (first, again):
        assert_same_from(out.prompt_logprobs, want.prompt_logprobs, start)


def test_start_zero_or_one_and_past_the_prompt(cached_engine, full):
    cached_engine.scheduler.reset_prefix_cache()
    prompt = CONTEXT[:9]
    (want,) = full([prompt])
    outs = run(cached_engine, [prompt] * 4, [score(0), score(1), score(9), score(50)])
    assert [o.metrics.num_cached_prompt_tokens for o in outs] == [0, 0, 8, 8]
    assert_same_from(outs[0].prompt_logprobs, want.prompt_logprobs, 1)
    assert_same_from(outs[1].prompt_logprobs, want.prompt_logprobs, 1)
    assert list(outs[2].prompt_logprobs) == [None] * 9 and list(outs[3].prompt_logprobs) == [None] * 9


def test_without_a_start_prompt_logprobs_still_compute_the_whole_prompt(cached_engine):
    cached_engine.scheduler.reset_prefix_cache()
    prompts = [CONTEXT + c for c in CHOICES]
    outs = run(cached_engine, prompts, [score()] * len(prompts))
    assert [o.metrics.num_cached_prompt_tokens for o in outs] == [0, 0, 0, 0]
    assert all(o.prompt_logprobs[j] is not None for o in outs for j in range(1, len(CONTEXT)))


def test_prompt_logprobs_start_is_checked():
    with pytest.raises(SamplingParamsError, match="prompt_logprobs_start.*needs prompt_logprobs"):
        SamplingParams(prompt_logprobs_start=3)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
    with pytest.raises(SamplingParamsError, match="skip_reading_prefix_cache"):
        SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)
    assert SamplingParams(prompt_logprobs=0, prompt_logprobs_start=5,
                          skip_reading_prefix_cache=False).max_cached_prompt_tokens == 4
    assert SamplingParams(prompt_logprobs=0, prompt_logprobs_start=5,
                          skip_reading_prefix_cache=True).max_cached_prompt_tokens == 0
    assert SamplingParams().max_cached_prompt_tokens is None


def test_a_hybrid_model_s_choices_start_from_the_context_s_state_snapshot(hybrid):
    """Qwen3.5 (Gated DeltaNet layers): a hit also needs the recurrent state after the cached blocks. The first
    choice snapshots it where its hit may end (the last block boundary before the first wanted logit), the
    others wait the one step until it is readable and start there; scores equal the cache off."""
    model = hybrid("qwen3.5")
    context = [(t * 37) % 500 + 3 for t in range(40)]
    prompts = [context + c for c in CHOICES]
    start = len(context)
    outs = {}
    for caching in (True, False):
        eng = LLMEngine(Config(model=str(model), device="cpu", dtype="float32", kvcache_block_size=8,
                               num_kvcache_blocks=128, max_num_seqs=16, enable_prefix_caching=caching))
        try:
            outs[caching] = run(eng, prompts, [score(start)] * len(prompts))
            stats = eng.stats
        finally:
            eng.shutdown()
        if caching:
            assert [o.metrics.num_cached_prompt_tokens for o in outs[True]] == [0, 32, 32, 32]
            assert stats.state_snapshot_hits == 3
    for got, want in zip(outs[True], outs[False]):
        assert_same_from(got.prompt_logprobs, want.prompt_logprobs, start)
