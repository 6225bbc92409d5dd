"""llmcli against HuggingFace transformers (the oracle), greedy, float32, CPU.

Every test runs llmcli and ``transformers`` on the same tiny random Qwen3
checkpoint (the matrix's core, ``family_model``: one of every family, conftest.FAMILIES) and compares the generated token ids, token for token, for every
prompt. The HF side is ``conftest.HFOracle``: one prompt at a time, no
padding, EOS disabled, so exactly ``max_new_tokens`` come out; llmcli runs with
``ignore_eos=True`` for the same reason (except in the EOS tests).

Near-ties: two implementations of the same float32 maths differ in the last
bits, so when HF's two best logits are closer than ``TIE_TOL`` either choice is
correct. ``assert_same_tokens`` accepts llmcli taking HF's runner-up at such a
position and stops comparing that prompt there (the continuations legitimately
diverge). Everything else must match exactly. The tiny models are built with
well-spread logits, so such ties are rare; a real bug moves logits by far more
than ``TIE_TOL``.

After every run all KV blocks must be back in the free pool with ref_count 0.
"""
from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass

import pytest
import torch

from llmcli import LLM, SamplingParams

TIE_TOL = 1e-4
NUM_TOKENS_IN_TOKENIZER = 600  # tiny_qwen3's tokenizer; ids 0..2 are the special tokens

# Very different lengths: 1 token, around block edges (16/17, 255/256/257), up to 300.
MIXED_LENGTHS = [1, 2, 7, 16, 17, 31, 48, 100, 150, 255, 256, 257, 300]
MAX_NEW = 32


def random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, NUM_TOKENS_IN_TOKENIZER, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(model_dir, **overrides) -> LLM:
    kwargs = dict(
        device="cpu",
        dtype="float32",
        kvcache_block_size=16,
        num_kvcache_blocks=1024,
        max_num_batched_tokens=4096,
        max_num_seqs=64,
        max_model_len=512,
        enable_prefix_caching=True,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


def describe(llm_kwargs: dict) -> str:
    keys = ("kvcache_block_size", "num_kvcache_blocks", "max_num_batched_tokens", "max_num_seqs",
            "enable_prefix_caching", "max_model_len")
    return ", ".join(f"{k}={llm_kwargs[k]}" for k in keys if k in llm_kwargs)


@dataclass
class Run:
    """One LLM built for one configuration, closed at the end of the test."""

    llm: LLM
    model_dir: object
    config: str


@pytest.fixture
def run_factory():
    made: list[LLM] = []

    def build(model_dir, **overrides) -> Run:
        llm = make_llm(model_dir, **overrides)
        made.append(llm)
        merged = dict(kvcache_block_size=16, num_kvcache_blocks=1024, max_num_batched_tokens=4096,
                      max_num_seqs=64, enable_prefix_caching=True, max_model_len=512)
        merged.update(overrides)
        return Run(llm, model_dir, describe(merged))

    yield build
    for llm in made:
        llm.shutdown()


# --------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------
def assert_same_tokens(hf_oracle, model_dir, prompts, outs, expected, config: str, tie_tol: float = TIE_TOL) -> None:
    """llmcli's ids equal HF's for every prompt, token for token (see the module docstring on ties; ``tie_tol``
    wider for kernels that round inside, as fla's TF32 dots on the GPU)."""
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    problems = []
    for i, (prompt, out, want) in enumerate(zip(prompts, outs, expected)):
        got = list(out["token_ids"])
        if got == want:
            continue
        j = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
        if j < min(len(got), len(want)):
            logits = hf_oracle.next_token_logits(model_dir, list(prompt) + want[:j])
            gap = float(logits[want[j]] - logits[got[j]])
            if 0.0 <= gap < tie_tol and len(got) == len(want):
                warnings.warn(f"prompt {i} (len {len(prompt)}): near-tie at new token {j} "
                              f"(HF {want[j]} vs llmcli {got[j]}, logit gap {gap:.2e}); rest not compared")
                continue
            problems.append(
                f"prompt {i} (len {len(prompt)}): first difference at new token {j}: HF {want[j]}, "
                f"llmcli {got[j]} (HF logit gap {gap:.3e}); HF {want[:j + 3]}..., llmcli {got[:j + 3]}..."
            )
        else:
            problems.append(f"prompt {i} (len {len(prompt)}): llmcli gave {len(got)} tokens, HF {len(want)}: "
                            f"HF {want}, llmcli {got}")
    assert not problems, f"llmcli != HF [{config}]:\n" + "\n".join(problems)


def assert_blocks_released(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    held = [b for b in bm.blocks if b.ref_count != 0]
    assert not held, f"{len(held)} blocks still referenced after the run, e.g. ids {[b.block_id for b in held[:8]]}"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks not back in the free pool"


def check_against_hf(run: Run, hf_oracle, prompts, max_new: int = MAX_NEW, **sp) -> list:
    expected = hf_oracle.greedy(run.model_dir, prompts, max_new)
    outs = run.llm.generate(prompts, greedy(max_new, **sp))
    assert_same_tokens(hf_oracle, run.model_dir, prompts, outs, expected, run.config)
    for out in outs:
        assert out["finish_reason"] == "length", out["finish_reason"]
    assert_blocks_released(run.llm)
    return outs


# --------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 256])
def test_mixed_lengths_batch(family_model, hf_oracle, run_factory, block_size):
    """(d) a batch of very different lengths at two block sizes, everything in one prefill step."""
    prompts = random_prompts(MIXED_LENGTHS, seed=100)
    num_blocks = 1024 if block_size == 16 else 64
    run = run_factory(family_model, kvcache_block_size=block_size, num_kvcache_blocks=num_blocks)
    check_against_hf(run, hf_oracle, prompts)


def test_chunked_prefill(family_model, hf_oracle, run_factory):
    """(a) max_num_batched_tokens=64 is far below the longest prompts: prefill goes in chunks."""
    prompts = random_prompts(MIXED_LENGTHS, seed=100)
    assert max(map(len, prompts)) > 64
    run = run_factory(family_model, max_num_batched_tokens=64)
    check_against_hf(run, hf_oracle, prompts)


def test_chunked_prefill_odd_budget_large_blocks(tiny_model, hf_oracle, run_factory):
    """Chunks that do not line up with block edges (budget 37), with 256-token blocks."""
    prompts = random_prompts([5, 90, 200, 299], seed=101)
    run = run_factory(tiny_model, max_num_batched_tokens=37, kvcache_block_size=256, num_kvcache_blocks=32)
    check_against_hf(run, hf_oracle, prompts)


def test_prefix_cache_across_calls(tiny_model, hf_oracle, run_factory):
    """(b) the second generate call reuses the shared prefix blocks registered by the first."""
    bs, shared_blocks = 16, 6
    prefix = random_prompts([shared_blocks * bs], seed=200)[0]
    tails1 = random_prompts([5, 17, 40], seed=201)
    tails2 = random_prompts([1, 9, 33, 70], seed=202)
    first = [prefix + t for t in tails1]
    second = [prefix + t for t in tails2]
    # An exact repeat of a first-call prompt whose length is a multiple of the block size:
    # every block of it is cached, yet one token must still be computed to sample from.
    exact = prefix + random_prompts([2 * bs], seed=203)[0]
    first.append(exact)
    second.append(list(exact))

    run = run_factory(tiny_model, kvcache_block_size=bs)
    stats = run.llm.engine.stats
    check_against_hf(run, hf_oracle, first)
    hits_before = stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, second)
    grown = stats.prefix_cache_hit_tokens - hits_before
    need = shared_blocks * bs * len(second)
    assert grown >= need, (f"prefix_cache_hit_tokens grew by {grown} in the second call; "
                           f"{len(second)} prompts share {shared_blocks} cached full blocks ({need} tokens)")


def test_reset_prefix_cache_makes_the_next_call_cold(tiny_model, hf_oracle, run_factory):
    """benchmarks/speed_gpu.py resets the prefix cache between timed runs: the same prompts then hit nothing,
    and are still computed right."""
    prompts = random_prompts([40, 70], seed=204)
    run = run_factory(tiny_model, kvcache_block_size=16)
    stats = run.llm.engine.stats
    check_against_hf(run, hf_oracle, prompts)
    run.llm.engine.scheduler.block_manager.reset_prefix_cache()
    hits_before = stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, prompts)
    assert stats.prefix_cache_hit_tokens == hits_before
    check_against_hf(run, hf_oracle, prompts)  # registered again by the cold call: now they hit
    assert stats.prefix_cache_hit_tokens >= hits_before + 16 * (2 + 4)


def test_prefix_cache_within_one_call(tiny_model, hf_oracle, run_factory):
    """(b) prompts of one generate call share a prefix: with max_num_seqs=1 each request runs
    after the previous one finished, so requests 2..n must hit the blocks request 1 registered."""
    bs, shared_blocks = 16, 5
    prefix = random_prompts([shared_blocks * bs], seed=210)[0]
    prompts = [prefix + t for t in random_prompts([3, 20, 47, 16], seed=211)]
    run = run_factory(tiny_model, kvcache_block_size=bs, max_num_seqs=1)
    stats = run.llm.engine.stats
    before = stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, prompts)
    grown = stats.prefix_cache_hit_tokens - before
    need = shared_blocks * bs * (len(prompts) - 1)
    assert grown >= need, f"prefix_cache_hit_tokens grew by {grown}; expected >= {need}"


def test_prefix_cache_concurrent_batch_with_chunking(family_model, hf_oracle, run_factory):
    """(b) one batch sharing a prefix, run concurrently with a small token budget (some requests
    are admitted while others are still prefilling); whatever is shared must give HF's tokens."""
    bs = 16
    prefix = random_prompts([7 * bs + 3], seed=220)[0]
    prompts = [prefix + t for t in random_prompts([1, 12, 29, 64, 100, 5], seed=221)]
    prompts.append(list(prompts[2]))  # a duplicate request in the same batch
    run = run_factory(family_model, kvcache_block_size=bs, max_num_batched_tokens=48)
    check_against_hf(run, hf_oracle, prompts)
    # Run the same batch again: now everything shared is in the cache.
    before = run.llm.engine.stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, prompts)
    assert run.llm.engine.stats.prefix_cache_hit_tokens - before >= 7 * bs * len(prompts)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption(tiny_model, hf_oracle, run_factory, prefix_caching):
    """(c) a pool of 12 blocks of 16 cannot hold 8 requests of up to 160 tokens: requests are preempted."""
    prompts = random_prompts([20, 33, 40, 47, 60, 70, 90, 110], seed=300)
    max_new = 48
    run = run_factory(tiny_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192,
                      enable_prefix_caching=prefix_caching, max_num_batched_tokens=192)
    check_against_hf(run, hf_oracle, prompts, max_new=max_new)
    assert run.llm.engine.stats.num_preemptions > 0, "the tiny KV pool should have forced preemption"


def test_preemption_with_chunked_prefill(family_model, hf_oracle, run_factory):
    """(a)+(c) preemption while prompts are prefilled in chunks of 24 tokens."""
    prompts = random_prompts([50, 75, 99, 120, 8, 64], seed=310)
    run = run_factory(family_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192,
                      max_num_batched_tokens=24)
    check_against_hf(run, hf_oracle, prompts, max_new=40)
    assert run.llm.engine.stats.num_preemptions > 0


def test_tied_embeddings(tiny_model_tied, hf_oracle, run_factory):
    """(e) a checkpoint without lm_head.weight (tie_word_embeddings=True)."""
    prompts = random_prompts(MIXED_LENGTHS, seed=400)
    run = run_factory(tiny_model_tied)
    check_against_hf(run, hf_oracle, prompts)


def test_sharded_checkpoint(tiny_model_sharded, hf_oracle, run_factory):
    """Several safetensors shards plus model.safetensors.index.json, loaded with load_format='safetensors'."""
    assert (tiny_model_sharded / "model.safetensors.index.json").is_file()
    assert len(list(tiny_model_sharded.glob("*.safetensors"))) > 1
    prompts = random_prompts([3, 40, 130, 260], seed=500)
    run = run_factory(tiny_model_sharded, load_format="safetensors", max_num_batched_tokens=128)
    check_against_hf(run, hf_oracle, prompts)


TEXT_PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a king who loved music",
    "Please write a short story about a robot who learns to paint pictures of the ocean. "
    "The robot lives in a small town near the coast, and every morning it walks to the harbour.",
    "What is the capital of France?",
    "Numbers: 1, 2, 3, 10, 42, 100 and 2024.",
    "a",
    "Good software is tested often, reviewed carefully, and written so that other people can read it. " * 4,
    "She said: \"Thank you for your help!\"",
]


def test_text_and_token_id_prompts(tiny_model, hf_oracle, run_factory):
    """(f) text prompts go through the model's tokenizer; the same ids given directly give the same output."""
    tok = hf_oracle.tokenizer(tiny_model)
    ids = [tok(t)["input_ids"] for t in TEXT_PROMPTS]
    assert all(ids), "every text prompt tokenizes to at least one id"
    run = run_factory(tiny_model, max_num_batched_tokens=100)
    expected = hf_oracle.greedy(tiny_model, ids, MAX_NEW)

    text_outs = run.llm.generate(TEXT_PROMPTS, greedy())
    assert_same_tokens(hf_oracle, tiny_model, ids, text_outs, expected, run.config + ", text prompts")
    assert_blocks_released(run.llm)

    id_outs = run.llm.generate(ids, greedy())
    assert_same_tokens(hf_oracle, tiny_model, ids, id_outs, expected, run.config + ", token-id prompts")
    assert [o["token_ids"] for o in id_outs] == [o["token_ids"] for o in text_outs]
    assert_blocks_released(run.llm)


def test_output_text_is_decoded_token_ids(tiny_model, hf_oracle, run_factory):
    """outs[i]["text"] is the tokenizer's decoding of outs[i]["token_ids"] (special tokens skipped)."""
    tok = hf_oracle.tokenizer(tiny_model)
    run = run_factory(tiny_model)
    outs = run.llm.generate(TEXT_PROMPTS[:4], greedy(24))
    for out in outs:
        assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)
    assert_blocks_released(run.llm)


# --------------------------------------------------------------------------
# EOS, stop tokens and max_tokens
# --------------------------------------------------------------------------
def _first_stop(expected: list[int], stop_ids) -> int:
    return min(expected.index(t) for t in stop_ids if t in expected)


def _assert_stopped_at(out, expected: list[int], k: int, what: str) -> None:
    got = list(out["token_ids"])
    # The stop token itself may be reported in token_ids or left out; nothing after it may be.
    assert got in (expected[:k + 1], expected[:k]), (
        f"{what}: generation should end at new token {k} (id {expected[k]}); HF {expected[:k + 2]}, llmcli {got}")
    assert out["finish_reason"] == "stop", f"{what}: finish_reason {out['finish_reason']!r}, expected 'stop'"


def _model_eos_ids(model_dir) -> list[int]:
    ids = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return list(ids) if isinstance(ids, list) else [ids]


def test_stop_token_ids_and_max_tokens(tiny_model, hf_oracle, run_factory):
    prompts = random_prompts([4, 30, 77], seed=600)
    expected = hf_oracle.greedy(tiny_model, prompts, MAX_NEW)
    eos_ids = _model_eos_ids(tiny_model)
    run = run_factory(tiny_model)
    for prompt, want in zip(prompts, expected):
        stop_id = want[5]
        # Generation ends at the first stop id or model EOS id that HF produces (step 5 at the latest).
        k = _first_stop(want, [stop_id] + eos_ids)
        [out] = run.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                          stop_token_ids=[stop_id]))
        _assert_stopped_at(out, want, k, f"stop_token_ids=[{stop_id}], prompt len {len(prompt)}")

        # max_tokens below the stop position: cut by length, exactly max_tokens ids.
        if k >= 2:
            [out] = run.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k - 1,
                                                              stop_token_ids=[stop_id]))
            assert list(out["token_ids"]) == want[:k - 1]
            assert out["finish_reason"] == "length"
        # Without stop ids and with ignore_eos, max_tokens gives exactly that many tokens and "length".
        [out] = run.llm.generate([prompt], greedy(7))
        assert list(out["token_ids"]) == want[:7] and out["finish_reason"] == "length"
    assert_blocks_released(run.llm)


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory, hf_oracle):
    """A copy of tiny_model whose generation_config lists, as its SECOND eos id, the token HF
    greedy produces at step 5 for ``EOS_PROMPT`` (the first listed id is the tokenizer's <|im_end|>)."""
    prompt = random_prompts([25], seed=700)[0]
    want = hf_oracle.greedy(tiny_model, [prompt], MAX_NEW)[0]
    target = want[5]
    path = tmp_path_factory.mktemp("tiny_qwen3_eos")
    for f in tiny_model.iterdir():
        shutil.copy(f, path / f.name)
    gen = json.loads((path / "generation_config.json").read_text())
    first_eos = gen["eos_token_id"][0]
    gen["eos_token_id"] = [first_eos, target] if target != first_eos else [first_eos]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path, prompt, want, gen["eos_token_id"]


def test_eos_from_generation_config(eos_model, hf_oracle, run_factory):
    path, prompt, want, eos_ids = eos_model
    run = run_factory(path)
    k = _first_stop(want, eos_ids)
    assert k <= 5
    [out] = run.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    _assert_stopped_at(out, want, k, f"generation_config eos {eos_ids}")

    # ignore_eos=True: the full length, identical to HF without EOS.
    [out] = run.llm.generate([prompt], greedy(MAX_NEW))
    assert list(out["token_ids"]) == want and out["finish_reason"] == "length"

    # In a batch with other requests (same settings): each finishes on its own terms.
    others = random_prompts([3, 60], seed=701)
    batch = [others[0], prompt, others[1]]
    outs = run.llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    _assert_stopped_at(outs[1], want, k, "eos inside a batch")
    for i, other_want in zip((0, 2), hf_oracle.greedy(path, others, MAX_NEW)):
        if any(t in other_want for t in eos_ids):
            _assert_stopped_at(outs[i], other_want, _first_stop(other_want, eos_ids), f"batch request {i}")
        else:
            assert list(outs[i]["token_ids"]) == other_want and outs[i]["finish_reason"] == "length"
    assert_blocks_released(run.llm)


# --------------------------------------------------------------------------
# mixed steps: running sequences decode in the same varlen step as new prompts' chunks
# --------------------------------------------------------------------------
def mixed_step_count(run: Run) -> int:
    return run.llm.engine.step_timer.steps.get("mixed", 0)


@pytest.mark.parametrize("mixed", [True, False])
def test_mixed_steps_chunked_prefill(tiny_model, hf_oracle, run_factory, mixed):
    """Prompts prefilled in chunks of 40 tokens while the ones already admitted keep decoding; with 4
    sequences at most, later prompts arrive as earlier ones finish. ``mixed=False``: the prefill-first
    scheduler (an option since mixed steps became the default) on the same workload."""
    prompts = random_prompts(MIXED_LENGTHS, seed=500)
    run = run_factory(tiny_model, max_num_batched_tokens=40, max_num_seqs=4, mixed_steps=mixed)
    check_against_hf(run, hf_oracle, prompts)
    if mixed:
        assert mixed_step_count(run) > 10, "the workload should have run decode rows beside prompt chunks"
    else:
        assert mixed_step_count(run) == 0


@pytest.mark.parametrize("mixed", [True, False])
def test_mixed_steps_prefix_hits(tiny_model, hf_oracle, run_factory, mixed):
    """Mixed steps (and prefill first) over prompts sharing a cached prefix (a block-aligned and an unaligned
    tail)."""
    bs = 16
    prefix = random_prompts([5 * bs + 3], seed=510)[0]
    prompts = [prefix + t for t in random_prompts([1, 16, 29, 64, 3], seed=511)] + random_prompts([90], seed=512)
    run = run_factory(tiny_model, kvcache_block_size=bs, max_num_batched_tokens=32, max_num_seqs=3, mixed_steps=mixed)
    check_against_hf(run, hf_oracle, prompts)
    before = run.llm.engine.stats.prefix_cache_hit_tokens
    check_against_hf(run, hf_oracle, prompts)
    assert run.llm.engine.stats.prefix_cache_hit_tokens - before >= 5 * bs * len(prompts[:5])
    assert (mixed_step_count(run) > 0) == mixed


@pytest.mark.parametrize("mixed", [True, False])
def test_mixed_steps_preemption(tiny_model, hf_oracle, run_factory, mixed):
    """A pool too small for every request: decode rows of a mixed step preempt, prompts still prefill (and
    the same with prefill first)."""
    prompts = random_prompts([50, 75, 99, 120, 8, 64, 33], seed=520)
    run = run_factory(tiny_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192,
                      max_num_batched_tokens=24, mixed_steps=mixed)
    check_against_hf(run, hf_oracle, prompts, max_new=40)
    assert run.llm.engine.stats.num_preemptions > 0
    assert (mixed_step_count(run) > 0) == mixed


def test_mixed_steps_take_no_more_steps_when_everything_fits(tiny_model, hf_oracle, run_factory):
    """Issue #13: when every request fits at once (the default bench), mixed steps should only happen while the
    prompts prefill, and take no more forwards, nor more non-graph (prefill or mixed) ones, than prefill first."""
    prompts = random_prompts([20, 45, 90, 120, 33, 64, 101, 7, 58, 77, 110, 26], seed=530)
    steps = {}
    for mixed in (False, True):
        run = run_factory(tiny_model, kvcache_block_size=16, max_num_batched_tokens=200, max_num_seqs=16,
                          mixed_steps=mixed)
        check_against_hf(run, hf_oracle, prompts)
        steps[mixed] = dict(run.llm.engine.step_timer.steps)
    eager = {m: s.get("prefill", 0) + s.get("mixed", 0) for m, s in steps.items()}
    assert steps[True].get("mixed", 0) > 0, steps
    assert eager[True] <= eager[False], steps
    assert sum(steps[True].values()) <= sum(steps[False].values()), steps


def test_mixed_steps_synchronous_loop_agrees(tiny_model, hf_oracle, run_factory):
    """The overlapped loop (in-flight tokens of decode rows taken on the device) against the plain one."""
    prompts = random_prompts([5, 40, 77, 12, 150], seed=530)
    run = run_factory(tiny_model, max_num_batched_tokens=24, max_num_seqs=3, mixed_steps=True)
    run.llm.engine.overlap = False
    check_against_hf(run, hf_oracle, prompts)
    assert mixed_step_count(run) > 0
