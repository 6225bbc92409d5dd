"""Prefix caching for hybrid models (Qwen3.5, Qwen3-Next) through linear-attention state snapshots
(engine/state_snapshots.py), against transformers (fp32 greedy, CPU, tiny random checkpoints).

A hit skips the prompt tokens whose KV blocks are cached and whose Gated DeltaNet state a snapshot holds; a wrong
snapshot (taken at the wrong token, read before it is written, overwritten while in use) changes the tokens.
"""
from __future__ import annotations

import os
import re
import sys
import types

import orjson
import pytest
import torch

from test_engine_vs_hf import assert_same_tokens, check_against_hf, greedy, random_prompts, run_factory  # noqa: F401

PREFIX = 96  # the shared system prompt: six blocks of 16


@pytest.fixture(scope="session")
def hybrid(tiny_checkpoint, tmp_path_factory):
    """``hybrid(family)``: the tiny checkpoint with a recurrent state that remembers. Its random decays forget a
    token within a few (exp(A_log) up to 16), so a wrong snapshot would hardly move a logit; here each head keeps
    ~99.7% of its state per token, as trained models' slow heads do."""
    from test_model_checks import _copy, _edit_tensors

    made = {}

    def slow(state):
        g = torch.Generator().manual_seed(0)
        for name in [n for n in state if n.endswith(("A_log", "dt_bias"))]:
            t = state[name]
            state[name] = torch.full_like(t, -2.0) if name.endswith("dt_bias") else \
                torch.empty_like(t).uniform_(0.005, 0.05, generator=g).log()

    def get(family: str):
        if family not in made:
            folder = _copy(tiny_checkpoint(family), tmp_path_factory.mktemp("long_memory"), family)
            made[family] = _edit_tensors(folder, slow)
        return made[family]

    return get


def shared_prefix_prompts(n: int, seed: int, prefix: int = PREFIX, lengths=(32, 48)) -> list[list[int]]:
    system = random_prompts([prefix], seed=seed)[0]
    g = torch.Generator().manual_seed(seed + 1)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [system + tail for tail in random_prompts(sizes, seed=seed + 2)]


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next"])
def test_shared_system_prompt_computes_each_prefix_once(family, hybrid, hf_oracle, run_factory):
    """40 requests behind one system prompt, a few per step: the first request to find the prefix cached
    recomputes it and snapshots its state at the branching point; every later one starts there."""
    model = hybrid(family)
    prompts = shared_prefix_prompts(40, seed=500, lengths=(1, 48))
    run = run_factory(model, kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=256)
    outs = check_against_hf(run, hf_oracle, prompts, max_new=4)
    cached = [out.metrics.num_cached_prompt_tokens for out in outs]
    assert cached[0] == 0 and all(c == PREFIX for c in cached[2:]), cached
    stats = run.llm.engine.stats
    unique = PREFIX + sum(len(p) - PREFIX for p in prompts)
    assert stats.prefill_tokens_computed <= 1.1 * unique, (stats.prefill_tokens_computed, unique)
    assert stats.state_snapshot_hits >= 38 and stats.state_snapshots_taken >= 2, stats


@pytest.mark.parametrize("block_size", [16, 64])
def test_hits_with_chunked_prefill_and_preemption(block_size, hybrid, hf_oracle, run_factory):
    """Three waves over prompts that branch at different depths, in chunks of 24 tokens, in a KV pool too small
    for every sequence: hits start mid-prompt from snapshots, preempted sequences recompute (and may hit)."""
    model = hybrid("qwen3.5")
    base = random_prompts([200], seed=510)[0]
    tails = random_prompts([5, 20, 7, 9, 15], seed=511)
    prompts = [base[:cut] + tail for cut, tail in zip([70, 100, 120, 60, 110], tails)]
    run = run_factory(model, kvcache_block_size=block_size, num_kvcache_blocks=14 if block_size == 16 else 4,
                      max_model_len=320, max_num_batched_tokens=24)
    for wave in (prompts[:2], prompts, prompts[::-1]):
        check_against_hf(run, hf_oracle, wave, max_new=40)
    stats = run.llm.engine.stats
    assert stats.num_preemptions > 0, "the tiny KV pool should have forced preemption"
    assert stats.prefix_cache_hit_tokens > 0 and stats.state_snapshot_hits > 0, stats


def test_lru_eviction_of_snapshot_slots(hybrid, hf_oracle, run_factory):
    """Two snapshot slots for three system prompts in turn: snapshots are recycled least recently used first
    while sequences read and write others; every output stays right."""
    model = hybrid("qwen3.5")
    groups = [shared_prefix_prompts(3, seed=s, prefix=48, lengths=(10, 20)) for s in (520, 530, 540)]
    run = run_factory(model, kvcache_block_size=16, max_num_batched_tokens=48, num_state_snapshots=2,
                      max_model_len=256)
    for wave in range(2):
        check_against_hf(run, hf_oracle, [p for g in groups for p in g], max_new=6)
    registry = run.llm.engine.scheduler.snapshots
    assert registry.num_slots == 2 and len(registry.by_hash) <= 2
    stats = run.llm.engine.stats
    assert stats.state_snapshots_taken > 2 and stats.state_snapshot_hits > 0, stats


def test_snapshots_off_computes_every_prompt_token(hybrid, hf_oracle, run_factory):
    """num_state_snapshots=0: no prefix hit may skip tokens whose linear-attention state is nowhere."""
    prompt = random_prompts([80], seed=420)
    run = run_factory(hybrid("qwen3.5"), kvcache_block_size=16, num_state_snapshots=0)
    check_against_hf(run, hf_oracle, prompt, max_new=4)
    check_against_hf(run, hf_oracle, prompt, max_new=4)
    assert run.llm.engine.stats.prefix_cache_hit_tokens == 0
    report = run.llm.engine.model_runner.memory_report
    assert report.num_state_snapshots == 0 and any("prefix caching is off" in n for n in report.notes)


def test_memory_report_counts_the_snapshot_slots(hybrid, run_factory):
    """The probe counts the snapshot rows beside the sequences' state rows, and probe-memory shows them."""
    import io

    from rich.console import Console

    from llmcli.cli.probe import render

    run = run_factory(hybrid("qwen3.5"), kvcache_block_size=16, max_num_seqs=6, num_state_snapshots=5)
    runner = run.llm.engine.model_runner
    report = runner.memory_report
    pages = report.state_pages
    row = pages.row_pages * report.kv_bytes_per_block
    assert report.num_state_snapshots == 5 and report.state_snapshot_bytes == 5 * row
    assert report.state_pool_bytes == (6 + 1 + 5 + 1) * row  # num_kvcache_blocks set: every row reserved
    assert report.num_blocks == 1024 + (6 + 1 + 5 + 1) * pages.row_pages
    assert runner.state_pool[0].shape[0] == 6 + 1 + 5 + 1  # rows, snapshots, scratch
    out = io.StringIO()
    render(report, None, Console(file=out, width=200))
    shown = out.getvalue()
    assert "state snapshots" in shown and "5 (" in shown
    assert f"{pages.row_pages} blocks" in shown and "linear-attention states per sequence" in shown
    as_json = orjson.loads(orjson.dumps(report.as_dict()))
    assert as_json["state_pages"] == {"row_pages": pages.row_pages, "seq_rows": 7, "fixed_rows": 6, "shared": False}


def _torch_varlen(q, k, v, g, beta, initial, cu_seqlens, chunk_indices=None):
    """fla's ``chunked_varlen`` contract in torch, one sequence at a time; the chunk indices given must be those
    fla would derive itself (``prepare_chunk_indices``, at its chunk length)."""
    from fla.ops.utils.index import prepare_chunk_indices

    from llmcli.kernels.gated_delta_torch import gated_delta_rule_chunked
    from llmcli.layers.state_segments import FLA_CHUNK

    assert chunk_indices is not None, "the runner's chunks carry fla's chunk indices"
    assert chunk_indices.tolist() == prepare_chunk_indices(cu_seqlens, FLA_CHUNK).tolist()
    cu = cu_seqlens.tolist()
    out, finals = v.new_empty(v.shape), []
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        out[a:b], s = gated_delta_rule_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial[i])
        finals.append(s)
    return out, torch.stack(finals)


def _torch_conv_varlen_(x, weight, conv_state, rows, has_initial_state, cu_seqlens):
    """kernels/triton_gated_delta.conv_varlen_'s contract in torch: each chunk continues its row's conv state
    when carried, and leaves its last K-1 inputs there."""
    from llmcli.kernels.gated_delta_torch import causal_conv1d

    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for i, row in enumerate(rows.tolist()):
        start = conv_state[row] if conv_state is not None and bool(has_initial_state[i]) else None
        out[cu[i]:cu[i + 1]], new = causal_conv1d(x[cu[i]:cu[i + 1]], weight, start)
        if conv_state is not None:
            conv_state[row].copy_(new)
    return out


def _torch_decode_in_place(self, mixed, a, b, weight, rows):
    g = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias.float())
    return self._decode(mixed, g, torch.sigmoid(b), weight, rows)


def _cuda_path_on_cpu(monkeypatch) -> None:
    """The CUDA path of the Gated DeltaNet layer on CPU: fla's varlen kernel and the Triton kernels (they need
    CUDA here) by torch stand-ins with their contracts."""
    import llmcli.layers.gated_delta_net as gdn

    fake = types.ModuleType("llmcli.kernels.gated_delta_fla")
    fake.chunked_varlen = _torch_varlen
    monkeypatch.setitem(sys.modules, "llmcli.kernels.gated_delta_fla", fake)
    kernels = types.ModuleType("llmcli.kernels.triton_gated_delta")
    kernels.conv_varlen_ = _torch_conv_varlen_
    monkeypatch.setitem(sys.modules, "llmcli.kernels.triton_gated_delta", kernels)
    monkeypatch.setattr(gdn.GatedDeltaNet, "_decode_in_place", _torch_decode_in_place)
    monkeypatch.setattr(gdn, "use_cuda_kernels", lambda x: True)


def test_varlen_passes_of_the_cuda_path(hybrid, hf_oracle, run_factory, monkeypatch):
    """The CUDA path's varlen delta rule in passes (chunks cut at snapshots), run on CPU with a torch stand-in
    for fla's kernel: same tokens as transformers, with hits."""
    import llmcli.layers.gated_delta_net as gdn

    _cuda_path_on_cpu(monkeypatch)
    calls = []
    real = gdn.GatedDeltaNet._chunk_passes
    monkeypatch.setattr(gdn.GatedDeltaNet, "_chunk_passes",
                        lambda self, *a: calls.append(len(a[-1].passes)) or real(self, *a))
    first = shared_prefix_prompts(1, seed=550, prefix=40, lengths=(30, 30))  # its last boundary is past the branch
    prompts = first + shared_prefix_prompts(5, seed=550, prefix=40, lengths=(1, 30))
    run = run_factory(hybrid("qwen3.5"), kvcache_block_size=16, max_num_batched_tokens=256,
                      max_model_len=256)
    # after the start-up warm-up (metadata made by hand), every step's layers find the chunks' host values in
    # the metadata: deriving them would read the device back in every layer (tolist), stalling the launch
    derived = []
    real_chunks_of = gdn.chunks_of
    monkeypatch.setattr(gdn, "chunks_of", lambda meta, pooled: derived.append(meta.chunks is None)
                        or real_chunks_of(meta, pooled))
    # the second wave starts in one step: its first request snapshots the branching point, which the others
    # may only read from the next step on (this path reads every chunk's initial state before any write)
    check_against_hf(run, hf_oracle, prompts[:1], max_new=5)
    check_against_hf(run, hf_oracle, prompts[1:], max_new=5)
    assert run.llm.engine.stats.state_snapshot_hits >= 4 and max(calls) > 1, calls
    assert derived and not any(derived)


@pytest.mark.parametrize("path", ["cpu", "cuda-on-cpu"])
def test_mixed_steps_decode_rows_apart_but_not_a_one_token_hit(path, hybrid, hf_oracle, run_factory, monkeypatch):
    """A mixed step's decode rows take the decode path (their states in place, no gather); a one-token chunk
    that starts from a snapshot (a prompt one token past a cached boundary) also looks like a decode row to
    attention, but its state is the snapshot's, not its row's: it must stay a chunk. Requests arrive while
    others decode (a 64-token budget), so such chunks run beside decode rows."""
    import llmcli.layers.gated_delta_net as gdn

    if path == "cuda-on-cpu":
        _cuda_path_on_cpu(monkeypatch)
    splits = []
    real = gdn.GatedDeltaNet.forward

    def spy(self, hidden):
        step = self.backend.metadata.linear_step if self.backend.metadata.is_prefill else None
        if step is not None and step.num_decode:
            splits.append((step.num_decode, step.rest is not None and step.rest.state_segments is not None))
        return real(self, hidden)

    monkeypatch.setattr(gdn.GatedDeltaNet, "forward", spy)
    system = random_prompts([48], seed=610)[0]  # three blocks of 16
    first = system + random_prompts([20], seed=611)[0]
    one_past = [system + [t] for t in (7, 11, 13, 17, 19)]  # each: a 3-block hit, then one token from a snapshot
    run = run_factory(hybrid("qwen3.5"), kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=256)
    check_against_hf(run, hf_oracle, [first, *one_past], max_new=12)
    assert run.llm.engine.stats.state_snapshot_hits >= 3
    assert any(reads for _, reads in splits), splits  # decode rows apart in a step whose chunks read snapshots


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")
def test_tp2_hits_from_snapshots(hybrid, hf_oracle):
    """Each rank holds its heads' snapshots; the plan's snapshot fields reach every rank. The pool is sized from
    memory (shared rows of pages: the ranks agree on a row's pages and the pool's)."""
    from llmcli import LLM

    model = hybrid("qwen3.5")
    prompts = shared_prefix_prompts(5, seed=560, prefix=48, lengths=(5, 30))
    llm = LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=2, kvcache_block_size=16,
              num_kvcache_blocks=None, kv_cache_memory_gib=0.001, max_num_batched_tokens=40, max_num_seqs=8,
              max_model_len=256, enforce_eager=True)
    try:
        assert llm.engine.model_runner.state_pages.shared
        outs = llm.generate(prompts, greedy(8))
        hits = llm.engine.stats.state_snapshot_hits
    finally:
        llm.shutdown()
    want = hf_oracle.greedy(model, prompts, 8)
    assert_same_tokens(hf_oracle, model, prompts, outs, want, "TP=2 qwen3.5 with snapshot hits")
    assert hits > 0


def test_bench_shared_system_prompt_on_a_hybrid(hybrid):
    """`llmcli bench`'s shared-prefix workload (the GPU preset's shape) on Qwen3.5: the prompt tokens it
    computes stay within 1.1x the unique ones, and its report counts the snapshots."""
    from typer.testing import CliRunner

    from llmcli.cli.app import app

    result = CliRunner().invoke(app, [
        "bench", "--model", str(hybrid("qwen3.5")), "--device", "cpu", "--dtype", "float32",
        "--load-format", "dummy", "--num-prompts", "40", "--prefix-len", "96", "--input-len", "30:50",
        "--output-len", "2", "--block-size", "16", "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
        "--max-model-len", "256", "--num-kvcache-blocks", "256", "--warmup", "0", "--json"])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert data["prompt_tokens_computed"] <= 1.1 * data["unique_prompt_tokens"], data
    assert data["state_snapshots"]["slots"] == 4 and data["state_snapshots"]["hits"] >= 30, data["state_snapshots"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_hits_on_cuda_with_fla(hf_oracle, hybrid):
    """fp32 on the GPU through fla's varlen kernel in passes (chunks cut at snapshots), eager and with decode
    graphs: transformers' tokens (on the CPU), with hits. Run on the GPU machine:
    ``python -m pytest -q tests/test_hybrid_prefix_cache.py -m gpu``."""
    from llmcli import LLM

    model = hybrid("qwen3.5")
    prompts = shared_prefix_prompts(12, seed=570, lengths=(1, 40))
    want = hf_oracle.greedy(model, prompts, 8)
    for eager in (True, False):
        llm = LLM(str(model), device="cuda", dtype="float32", kvcache_block_size=16, max_model_len=256,
                  max_num_batched_tokens=64, enforce_eager=eager, gpu_memory_utilization=0.3)
        try:
            outs = llm.generate(prompts, greedy(8))
            hits = llm.engine.stats.state_snapshot_hits
        finally:
            llm.shutdown()
        # fla's chunked kernel rounds its fp32 dots to TF32: a top-2 gap of a few 1e-3 may flip (seen: 5.6e-3 on
        # an H200); a wrong snapshot moves tokens far past that (this file's slowly-decaying heads)
        assert_same_tokens(hf_oracle, model, prompts, outs, want, f"CUDA fla, enforce_eager={eager}", tie_tol=2e-2)
        assert hits >= 10


def test_generate_summary_reports_the_snapshots(hybrid, tmp_path):
    """`llmcli generate`'s summary says how many snapshot slots a hybrid model has, their memory, and how
    often prompts started from one."""
    from typer.testing import CliRunner

    from llmcli.cli.app import app

    records = [{"prompt_token_ids": p, "max_tokens": 2} for p in shared_prefix_prompts(4, seed=580, lengths=(3, 9))]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    result = CliRunner().invoke(app, ["generate", str(inp), "--model", str(hybrid("qwen3.5")), "--device", "cpu",
                                      "--block-size", "16", "--max-num-batched-tokens", "64", "--max-model-len", "256",
                                      "--num-kvcache-blocks", "64", "--num-state-snapshots", "3"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stderr.splitlines() if "state snapshots (hybrid prefix cache)" in x)
    assert re.search(r"3 slots \(0\.\d\d GiB\), [1-9]\d* taken, [1-9]\d* hits", line), line


def test_registry_hits_waits_recycles_and_releases():
    """The registry alone: a hit is the deepest snapshot written in an earlier step; a request whose deeper
    snapshot is still to be written waits; slots are recycled least recently used first, never one a step
    reads or one not written yet; a creator that gives its blocks back drops what it had not written."""
    from llmcli.engine.state_snapshots import WAIT, SnapshotRegistry
    from llmcli.engine.step_plan import StepPlan
    from llmcli.sampling_params import SamplingParams

    def seq(tokens):
        from llmcli.engine.sequence import Sequence

        s = Sequence(tokens, SamplingParams(max_tokens=1), 4)
        s.num_scheduled_tokens = len(tokens)  # the whole prompt in one chunk
        return s

    def plan_step(reg, *seqs):
        plan = StepPlan(True, *([None] * 6))
        reg.plan(plan, list(seqs))
        return plan

    reg = SnapshotRegistry(2, 4)
    a = seq(list(range(10)))  # boundaries after 4 and 8 tokens
    assert reg.admit(a, reg.hashes(a), 0) == 0 and a.state_source == -1
    assert [w[0] for w in a.snapshot_writes] == [8]  # no KV match: only its last boundary
    b = seq(list(range(9)) + [99])  # the same first 8 tokens
    assert reg.admit(b, reg.hashes(b), 2) == WAIT  # a's snapshot at 8 is not written yet
    slot = a.snapshot_writes[0][2].slot
    assert plan_step(reg, a).state_writes == [(0, 8, slot)] and not a.snapshot_writes
    assert reg.admit(b, reg.hashes(b), 2) == 2 and b.state_source == slot and reg.hits == 1
    c = seq([7] * 10)  # another prompt in the same step takes the free slot
    assert reg.admit(c, reg.hashes(c), 0) == 0 and [w[2].slot for w in c.snapshot_writes] == [1 - slot]
    x = seq([6] * 10)  # and then none is left: a's is read in this step, c's not written yet
    reg.admit(x, reg.hashes(x), 0)
    assert x.snapshot_writes == []
    plan = plan_step(reg, b, c)
    assert plan.state_reads == [(0, slot)] and plan.state_writes == [(1, 8, 1 - slot)]
    d = seq([8] * 10)  # the next step: a's snapshot, least recently used, is recycled
    reg.admit(d, reg.hashes(d), 0)
    assert [w[2].slot for w in d.snapshot_writes] == [slot] and len(reg.by_hash) == 2
    e = seq([9] * 10)  # then c's; then none (both wait to be written)
    reg.admit(e, reg.hashes(e), 0)
    f = seq([5] * 10)
    reg.admit(f, reg.hashes(f), 0)
    assert [w[2].slot for w in e.snapshot_writes] == [1 - slot] and f.snapshot_writes == []
    reg.release(d)  # d is preempted before its chunk ran: its slot comes back
    assert reg.free_slots == [slot] and d.snapshot_writes == []


def test_first_pass_covers_every_chunk_without_a_gather():
    """A cut in one chunk of a mixed step: the first pass is every chunk's first segment and names no entries
    (the layer runs it on the step's whole state, which a thousand decode rows make gigabytes per layer on a
    9B hybrid, not on a gathered copy); the second pass is the cut chunk's rest alone."""
    from llmcli.engine.uploader import Uploader
    from llmcli.layers.state_segments import state_segments

    # three decode rows, then a 10-token chunk cut after 4 tokens, then a 5-token chunk
    cu = [0, 1, 2, 3, 13, 18]
    seg = state_segments([0, 1, 2, 3, 4], cu, [(3, 9)], [(3, 4, 8)], Uploader(torch.device("cpu")))
    first, second = seg.passes
    assert first.entries is None
    assert first.tokens.tolist() == [0, 1, 2, 3, 4, 5, 6, 13, 14, 15, 16, 17]
    assert first.cu_seqlens.tolist() == [0, 1, 2, 3, 7, 12] and first.snapshots == [(3, 8)]
    assert second.entries.tolist() == [3] and second.tokens.tolist() == list(range(7, 13))
    assert seg.sources == [0, 1, 2, 9, 4]


def test_shared_system_prompt_takes_no_more_steps_than_no_cache(hybrid, run_factory):
    """The shape of configs/bench-shared-system-prompt.toml, scaled down (a few hundred tokens of system prompt,
    a tail of its own each, more requests than fit at once, mixed steps): with the cache on, the engine runs no
    more steps than with it off, the shared prefix's snapshot is created once (end-of-prompt snapshots of
    unique tails recycle the other slots, never the one every request hits), and hardly any request waits for
    a snapshot being written."""
    from llmcli import SamplingParams
    from llmcli.engine.state_snapshots import WAIT, SnapshotRegistry

    prompts = shared_prefix_prompts(48, seed=560, prefix=56, lengths=(30, 45))
    created, waits = [], []
    take, admit = SnapshotRegistry._take, SnapshotRegistry.admit

    def counting_take(self, h):
        snap = take(self, h)
        if snap is not None:
            created.append(h)
        return snap

    def counting_admit(self, seq, hashes, kv_blocks):
        depth = admit(self, seq, hashes, kv_blocks)
        waits.append(depth == WAIT)
        return depth

    steps, tokens, hits = {}, {}, 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SnapshotRegistry, "_take", counting_take)
        mp.setattr(SnapshotRegistry, "admit", counting_admit)
        for cache in (True, False):
            run = run_factory(hybrid("qwen3.5"), kvcache_block_size=16, max_num_seqs=12, max_num_batched_tokens=192,
                              max_model_len=256, enable_prefix_caching=cache, num_state_snapshots=4,
                              mixed_steps=True)
            outs = run.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
            tokens[cache] = [list(o.outputs[0].token_ids) for o in outs]
            steps[cache] = run.llm.engine.stats.num_steps
            hits = run.llm.engine.stats.state_snapshot_hits if cache else hits
    assert len(set(created)) == len(created), "a snapshot was evicted and created again"
    assert hits >= len(prompts) - 3, hits  # the first requests compute the prefix before it is cached
    assert steps[True] <= steps[False], steps
    assert sum(waits) <= 2, sum(waits)
    assert tokens[True] == tokens[False]


def test_memory_probe_of_a_hybrid_on_cuda_has_a_row_per_sequence():
    """The start-up probe's prefill on a hybrid model on CUDA: the whole token budget over max_num_seqs rows (a
    mixed step of that many decode rows holds every row's linear-attention state in each layer's temporaries);
    other models, or the CPU, keep chunks as long as max_model_len allows."""
    from llmcli.engine.warmup import probe_lens

    cfg = types.SimpleNamespace(max_model_len=40960, max_num_seqs=1024)
    assert probe_lens(cfg, 16384) == [16384]
    assert probe_lens(cfg, 16384, many_rows=True) == [1] * 1023 + [15361]
    short = types.SimpleNamespace(max_model_len=4096, max_num_seqs=6)
    assert probe_lens(short, 16384, many_rows=True) == [1, 1, 4094, 4096, 4096, 4096]
    assert probe_lens(types.SimpleNamespace(max_model_len=64, max_num_seqs=4), 16, many_rows=True) == [1, 1, 1, 13]


def test_a_large_hybrid_keeps_max_num_seqs_where_its_states_fit_beside_kv():
    """Qwen3.6-27B's published shape: 48 linear layers of 48 value heads with 128 x 128 float32 states (and a conv
    state of 10,240 channels x 3 in bf16) take ~147 MiB a sequence, 37 KV blocks of 4 MiB (16 full-attention
    layers, 4 KV heads of 256, block 64). With ~70 GiB left after the weights the shared pool keeps the default
    256 sequences (a fixed half for states held 209); at 1,024 it comes down to as many as fit beside one
    sequence of max_model_len (static: beside num_kvcache_blocks), said in one line; a pool too small for one
    sequence gives 0."""
    from llmcli.engine.state_pool import plan_state_pages

    row = 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)
    page = 64 * 2 * 16 * 4 * 256 * 2
    assert 146 * 2**20 < row < 148 * 2**20 and page == 4 * 2**20
    row_pages = -(-row // page)
    assert row_pages == 37
    hf = types.SimpleNamespace(layer_types=["linear_attention"] * 3 + ["full_attention"])

    def config(n):
        return types.SimpleNamespace(max_num_seqs=n, enable_prefix_caching=True, num_state_snapshots=None,
                                     hf_config=hf, max_model_len=4096)

    pool, kv_min = 70 * 2**30 // page, 4096 // 64
    cfg = config(256)
    pages, line = plan_state_pages(cfg, row_pages, pool, kv_min, shared=True)
    assert line is None and cfg.max_num_seqs == 256
    assert (pages.seq_rows, pages.fixed_rows, pages.row_pages, pages.shared) == (257, 16 + 1, 37, True)
    assert pages.reserved == 17 * 37 and pages.kv_room(pool) == pool - 18 * 37
    cfg = config(1024)
    pages, line = plan_state_pages(cfg, row_pages, pool, kv_min, shared=True)
    n = cfg.max_num_seqs
    assert line.startswith(f"max_num_seqs lowered from 1024 to {n}: ") and "37 KV blocks" in line
    used = (n + 1 + min(32, n // 16) + 1) * 37
    assert used + kv_min <= pool < used + kv_min + 2 * 37  # as many as fit, not fewer
    assert 400 < n < 500 and pages.seq_rows == n + 1
    cfg = config(1024)  # static: every row beside the num_kvcache_blocks asked for, as memory holds them
    pages, line = plan_state_pages(cfg, row_pages, pool, 10000, shared=False)
    n = cfg.max_num_seqs
    assert "the 10000 num_kvcache_blocks" in line and 150 < n < 250 and not pages.shared
    assert pages.rows * 37 + 10000 <= pool < (pages.rows + 2) * 37 + 10000
    cfg = config(64)
    plan_state_pages(cfg, row_pages, 5 * 37, kv_min, shared=True)
    assert cfg.max_num_seqs == 0


def test_an_engine_whose_states_do_not_all_fit_runs_with_fewer_sequences(hybrid, hf_oracle, run_factory):
    """The runner lowers max_num_seqs before the scheduler is made from it (a pool of ~70 blocks, sized from
    kv_cache_memory_gib as a GPU's probe sizes it from the memory left): the scheduler admits that many, the
    buffer has their rows, the memory report says why, and the tokens still equal transformers'."""
    path = hybrid("qwen3.5")
    first = run_factory(path, max_num_seqs=4).llm.engine.model_runner.memory_report
    row_pages, page = first.state_pages.row_pages, first.kv_bytes_per_block
    kv_min = 512 // 16  # max_model_len 512, block 16
    pages = (3 + 1 + 4 + 1) * row_pages + kv_min + row_pages - 1  # three sequences' rows, not four
    run = run_factory(path, max_num_seqs=16, num_kvcache_blocks=None, kv_cache_memory_gib=pages * page / 2**30)
    engine = run.llm.engine
    assert engine.model_runner.memory_report.num_blocks == pages
    assert engine.scheduler.max_num_seqs == 3 and engine.config.max_num_seqs == 3
    assert engine.model_runner.state_pool[0].shape[0] == 3 + 1 + 4 + 1  # rows, snapshots, scratch
    assert engine.model_runner.memory_report.notes[0].startswith("max_num_seqs lowered from 16 to 3: ")
    check_against_hf(run, hf_oracle, random_prompts([20, 40, 33, 27, 45, 38], seed=5), max_new=6)


def test_a_pool_too_small_for_one_sequences_states_is_refused_saying_so(hybrid, run_factory):
    from llmcli.engine.kv_cache import KVCacheTooSmall

    path = hybrid("qwen3.5")
    first = run_factory(path, max_num_seqs=4).llm.engine.model_runner.memory_report
    pages = (1 + 1 + 4 + 1) * first.state_pages.row_pages  # one sequence's rows and the fixed ones, no KV beside
    with pytest.raises(KVCacheTooSmall, match="not one sequence's linear-attention states") as refused:
        run_factory(path, max_num_seqs=4, num_kvcache_blocks=None,
                    kv_cache_memory_gib=pages * first.kv_bytes_per_block / 2**30)
    report = refused.value.report
    assert report.num_blocks == 0 and report.cache_tokens == 0 and report.max_concurrent_full_seqs == 0
