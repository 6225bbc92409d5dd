"""Tensor parallelism on CPU (gloo): same greedy tokens as one rank and as transformers; failures end fast and clean.

Equality: TP=2 sums the row-parallel partial products in a different order
than TP=1, so logits differ in the last float32 bits. The tiny checkpoints have
well-spread logits, so the tokens must be identical; the only tolerated
difference is a near-tie of HF's two best logits (gap < ``TIE_TOL``), after
which that prompt is not compared further (the continuations diverge).

After every test no child process of this test process (other than
multiprocessing's resource tracker) and no ``/dev/shm/llmcli_tp_<pid>_*``
segment may remain; tests that run a separate Python process also check that
its workers and its segment are gone once it has exited.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from llmcli import LLM, SamplingParams
from llmcli.config import ConfigError
from llmcli.parallel.exits import describe_ended
from llmcli.parallel.heartbeat import Heartbeat, SilenceMonitor
from llmcli.parallel.shm_channel import SHM_PREFIX, ControlChannel, PayloadTooLarge
from llmcli.parallel.tp_group import Group
from llmcli.parallel.tp_runner import TensorParallelError
from llmcli.engine.sequence import PENDING_TOKEN, Sequence
from llmcli.engine.step_inputs import Uploader, prepare_decode, prepare_prefill

from processes import child_processes, wait_gone
from tiny_qwen3 import write_tiny_qwen3

CPU = Uploader(torch.device("cpu"))

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")

REPO = Path(__file__).resolve().parents[1]
TIE_TOL = 1e-4
VOCAB_IN_TOKENIZER = 600
BLOCK = 16
MAX_NEW = 16


# --------------------------------------------------------------------------
# checkpoints and helpers
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    """Heads 4 / KV heads 2 / MLP 128 divide by 2; the odd vocabulary (641) pads rank 1's embedding shard."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_tp"), seed=11, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=641)


@pytest.fixture(scope="module")
def tp_model_tied(tmp_path_factory) -> Path:
    """Tied embeddings: the lm_head shares the vocabulary-parallel embedding shard."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_tp_tied"), seed=12, tie_word_embeddings=True,
                            num_attention_heads=4, num_key_value_heads=2)


def random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_IN_TOKENIZER, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(model_dir, tp: int, **overrides) -> LLM:
    kwargs = dict(device="cpu", dtype="float32", tensor_parallel_size=tp, kvcache_block_size=BLOCK,
                  num_kvcache_blocks=256, max_num_batched_tokens=48, max_num_seqs=16, max_model_len=512,
                  enforce_eager=True)
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


def assert_same_tokens(hf_oracle, model_dir, prompts, got_all, want_all, what: str) -> None:
    problems = []
    for i, (prompt, got, want) in enumerate(zip(prompts, got_all, want_all)):
        if got == want:
            continue
        j = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), None)
        if j is not None and len(got) == len(want):
            logits = hf_oracle.next_token_logits(model_dir, list(prompt) + want[:j])
            gap = abs(float(logits[want[j]] - logits[got[j]]))
            if gap < TIE_TOL:
                warnings.warn(f"{what}: prompt {i}: near-tie at new token {j} (gap {gap:.1e}); rest not compared")
                continue
            problems.append(f"prompt {i} (len {len(prompt)}): first difference at new token {j}: "
                            f"{want[j]} vs {got[j]} (HF logit gap {gap:.2e})")
        else:
            problems.append(f"prompt {i} (len {len(prompt)}): {want} vs {got}")
    assert not problems, f"{what}:\n" + "\n".join(problems)


def own_children() -> list[str]:
    """Live or unreaped children of this process, except multiprocessing's resource tracker."""
    return [f"pid {pid} state {state}: {cmd[:120]}" for pid, state, cmd in child_processes(os.getpid())]


def event_semaphores(runner) -> list[str]:
    """/dev/shm names of the control channel's named POSIX semaphores ("spawn" makes them)."""
    spec = runner._group.channel.spec
    names = ["sem." + sem._semlock.name.lstrip("/") for sem in spec.commands + spec.acks]
    assert all(name != "sem." for name in names)
    return names


def existing(names) -> list[str]:
    return [n for n in names if Path("/dev/shm", n).exists()]


def segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"{SHM_PREFIX}{pid}_")]


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    deadline = time.monotonic() + 5
    while (multiprocessing.active_children() or own_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children(), multiprocessing.active_children()
    assert not own_children(), own_children()
    assert not segments_of(os.getpid()), segments_of(os.getpid())
    import torch.distributed as dist

    assert not dist.is_initialized(), "the process group outlived the engine"


# --------------------------------------------------------------------------
# the compact form and the channel (no processes)
# --------------------------------------------------------------------------
def test_workers_plan_rebuilds_the_same_step_inputs():
    """What crosses to the other ranks is the step plan without what only sampling reads: pickled and read
    into a worker's own block tables, it gives the same step tensors as rank 0's, and only a chunk's tokens
    (a decode step: the last token) cross, not the history."""
    import pickle

    from llmcli.engine.block_tables import BlockTables
    from llmcli.engine.plan_builder import PlanBuilder

    prompts = random_prompts([40, 7, 33], seed=1)
    params = greedy()
    seqs = [Sequence(p, params, BLOCK) for p in prompts]
    for i, s in enumerate(seqs):
        s.block_table = [10 * i + b for b in range(s.num_blocks)]
        s.table_row, s.table_id = i, i + 1
    builder = PlanBuilder(BLOCK, [])
    rank0, worker = (BlockTables(8, BLOCK, torch.device("cpu")) for _ in range(2))

    def both(plan, prepare):
        sent = pickle.loads(pickle.dumps(plan.for_workers()))
        assert sent.extras is None and not sent.new_rows
        rank0.write(plan.blocks, CPU)
        worker.write(sent.blocks, CPU)
        return prepare(plan, CPU, rank0), prepare(sent, CPU, worker), sent

    # a chunk in the middle of a prompt, a whole short prompt, a prompt with a cached prefix
    seqs[0].num_computed_tokens, seqs[0].num_scheduled_tokens = 16, 20
    seqs[1].num_scheduled_tokens = 7
    seqs[2].num_computed_tokens, seqs[2].num_scheduled_tokens = 32, 1
    a, b, sent = both(builder.prefill(seqs, seqs[1:]), prepare_prefill)
    assert len(sent.tokens) == 28  # only the chunks' tokens cross
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("slot_mapping", "context_lens", "block_tables", "cu_seqlens_q", "cu_seqlens_k"):
        assert torch.equal(getattr(a.metadata, name), getattr(b.metadata, name)), name
    assert sent.samples.tolist() == [False, True, True]

    for s in seqs:  # decode: every prompt computed, one generated token each
        s.append_token(5)
        s.num_computed_tokens, s.num_scheduled_tokens = s.num_tokens - 1, 1
        s.block_table = [7 + b for b in range(s.num_blocks)]
        s.table_id += 10  # new blocks from the start: a new allocation
    a, b, sent = both(builder.decode(seqs), prepare_decode)
    assert sent.tokens.tolist() == [5, 5, 5]  # the last token, not the history
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.pending_rows is None and b.pending_rows is None
    for name in ("slot_mapping", "context_lens", "block_tables"):
        assert torch.equal(getattr(a.metadata, name), getattr(b.metadata, name)), name

    # the overlapped loop: the newest token of two sequences is still in flight, in rows 1 and 0
    for i, row in ((0, 1), (2, 0)):  # what Scheduler.launched does for a sampled sequence
        seqs[i].token_ids.append(PENDING_TOKEN)
        seqs[i].num_pending, seqs[i].pending_row = 1, row
    a, b, sent = both(builder.decode(seqs), prepare_decode)
    assert b.pending_rows.tolist() == [1, -1, 0]
    for name in ("input_ids", "positions", "pending_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_worker_phase_change_reaches_rank_0_at_once_and_silence_is_judged_on_rank_0s_clock():
    channel = ControlChannel.create(multiprocessing.get_context("spawn"), 2, payload_bytes=4096)
    try:
        heartbeat = Heartbeat(channel, 1, limit_s=1000.0)  # its thread is not started: only `say` beats
        monitor = SilenceMonitor(limit_s=0.2)
        assert channel.read_beat(1) == (0, "")
        assert monitor.silent(channel, [1]) is None  # no beat yet: the start-up timeout's business
        heartbeat.say("running a decode step (control call 7)")
        assert channel.read_beat(1) == (1, "running a decode step (control call 7)")
        heartbeat.say("waiting")  # a shorter text must not keep the tail of the longer one
        assert channel.read_beat(1) == (2, "waiting")
        assert monitor.silent(channel, [1]) is None  # first look: the clock starts now
        time.sleep(0.3)
        silence = monitor.silent(channel, [1])
        assert silence is not None and silence.rank == 1 and silence.doing == "waiting" and silence.seconds > 0.2
        heartbeat.say("running a prefill step (control call 8)")
        assert monitor.silent(channel, [1]) is None  # a beat resets the clock
    finally:
        channel.close()
        channel.unlink()


def _wait_for_a_call(spec) -> None:
    """Runs in a spawned process: a worker idle between calls (killed there by the test)."""
    channel = ControlChannel.attach(spec)
    channel.beat(1, "waiting")
    channel.wait_command(1, 600.0)


def test_posting_to_a_worker_killed_while_it_waited_returns_at_once():
    """A worker killed while it waited for a call must not block rank 0's next post (the watchdog could then only
    end the process: a rare CI failure). multiprocessing.Event.set waited for the dead sleeper to wake."""
    ctx = multiprocessing.get_context("spawn")
    channel = ControlChannel.create(ctx, 2, payload_bytes=4096)
    worker = ctx.Process(target=_wait_for_a_call, args=(channel.spec,))
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while channel.read_beat(1)[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # from its beat into the wait
        worker.kill()
        worker.join(10)
        posted = []
        poster = threading.Thread(target=lambda: posted.append(channel.post("run", (1,), lambda: None)), daemon=True)
        poster.start()
        poster.join(10)
        assert posted == [1], "rank 0's post blocked on a worker killed while it waited for a call"
    finally:
        if worker.is_alive():
            worker.kill()
        channel.close()
        channel.unlink()


def test_channel_rejects_an_oversized_payload():
    channel = ControlChannel.create(multiprocessing.get_context("spawn"), 2, payload_bytes=4096)
    try:
        assert channel.name.startswith(f"{SHM_PREFIX}{os.getpid()}_")
        with pytest.raises(PayloadTooLarge, match="LLMCLI_TP_SHM_MIB"):
            channel.post("run", (list(range(10_000)),), lambda: None)
        channel.write_error(1, "boom\n" * 3)
        assert channel.read_error(1) == "boom\n" * 3
    finally:
        channel.close()
        channel.unlink()


class _SlowToReap:
    """A process whose sentinel has fired but whose exit status the kernel hands out only after ``reap_s``."""

    def __init__(self, reap_s: float) -> None:
        self.reap_s, self.exitcode, self.waited = reap_s, None, 0.0

    def join(self, timeout: float) -> None:
        self.waited = min(timeout, self.reap_s)
        if timeout >= self.reap_s:
            self.exitcode = 1


def test_an_ended_process_is_described_by_its_exit_status_even_when_slow_to_reap():
    """A CI run reported a worker that raised as "not responding": its status came later than the 0.5 s waited."""
    slow = _SlowToReap(reap_s=3.0)
    assert describe_ended(slow) == "exited with status 1" and slow.waited == 3.0
    assert describe_ended(_SlowToReap(reap_s=3.0), settle_s=0.1) == "is exiting (no exit status yet)"


class _ReapedByAnotherThread(_SlowToReap):
    """Another thread's poll reaped the child: join returns at once with no status, which appears a moment later."""

    def join(self, timeout: float) -> None:
        threading.Timer(0.2, setattr, (self, "exitcode", 1)).start()


def test_an_exit_reaped_by_another_thread_is_still_described_by_its_status():
    """A CI run reported a worker that raised as "is exiting (no exit status yet)": rank 0's poll and the
    watchdog both waited on the child, and the one that lost the waitpid race saw no status."""
    assert describe_ended(_ReapedByAnotherThread(reap_s=0.0)) == "exited with status 1"


def test_rank0_counts_a_fired_sentinel_as_an_exit_before_the_status_comes():
    """After a communication error rank 0 waits FAILURE_SETTLE_S for the dead worker to show up; a worker whose
    status lags its sentinel past that must still be found, and named with its status."""
    group = Group(world=2, grace_s=5.0)
    sentinel, worker_end = os.pipe()
    os.close(worker_end)  # the worker's end is closed: its sentinel has fired
    proc = _SlowToReap(reap_s=1.0)
    proc.sentinel, proc.pid = sentinel, 4242
    group.procs[1] = proc
    try:
        failure = group.wait_for_failure(0.3)
        assert failure is not None and failure.startswith("tensor-parallel rank 1 (pid 4242) exited with status 1")
    finally:
        for fd in (sentinel, group._wake_r, group._wake_w):
            os.close(fd)


def test_head_counts_not_divisible_fail_at_start_up(tmp_path, tp_model):
    """One KV head cannot be split over 2 ranks (replication is not supported): a clear error, no process started."""
    model = tmp_path / "kv1"
    shutil.copytree(tp_model, model, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_key_value_heads"] = 1
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=1 is not divisible by 2.*not supported.*"
                                          r"may be one of 1$"):
        make_llm(model, 2, load_format="dummy")


def test_expert_size_not_divisible_fails_at_start_up(tmp_path, tiny_checkpoint):
    """Every expert's intermediate dimension is split like the dense MLP's: an odd one is refused by name."""
    model = tmp_path / "moe_odd"
    shutil.copytree(tiny_checkpoint("qwen3-moe-top2"), model, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((model / "config.json").read_text())
    cfg["moe_intermediate_size"] = 33
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=33 is not divisible by 2.*may be one of 1$"):
        make_llm(model, 2, load_format="dummy")


# --------------------------------------------------------------------------
# TP=2 == TP=1 == transformers
# --------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["untied_odd_vocab", "tied", "llama", "qwen2", "qwen3-moe-top2", "gpt-oss"])
def test_tp2_matches_tp1_and_hf(which, tp_model, tp_model_tied, tiny_checkpoint, hf_oracle):
    """llama: q/k/v, o_proj and MLP biases (q/k/v and gate/up split like their weight rows, o_proj and down_proj
    added once, on rank 0); qwen2: q/k/v bias and tied embeddings; qwen3-moe-top2: each rank holds half of every
    expert's intermediate dimension (and of the dense layer's MLP), the router on both; gpt-oss: half the heads'
    sinks, half of every expert's interleaved gate/up columns and their bias, the down bias once (rank 0), with
    prefix hits past its 24-key window."""
    model = {"untied_odd_vocab": tp_model, "tied": tp_model_tied}.get(which) or tiny_checkpoint(which)
    prefix = random_prompts([5 * BLOCK], seed=20)[0]
    first = random_prompts([1, 9, 17, 70, 130], seed=21) + [prefix + t for t in random_prompts([3, 30], seed=22)]
    second = [prefix + t for t in random_prompts([1, 16, 45], seed=23)] + [list(first[-1])]
    assert max(map(len, first)) > 48  # chunked prefill: the budget is 48 tokens

    results = {}
    for tp in (1, 2) if which == "untied_odd_vocab" else (2,):  # others: TP=1 vs HF is test_engine_vs_hf's job
        llm = make_llm(model, tp)
        try:
            if tp == 2:
                runner = llm.engine.model_runner
                assert len(runner.worker_pids) == 1 and runner.shm_name.startswith(f"{SHM_PREFIX}{os.getpid()}_")
                sems = event_semaphores(runner)
                assert existing(sems) == sems and len(sems) == 2
            stats = llm.engine.stats
            a = [o["token_ids"] for o in llm.generate(first, greedy())]
            hits = stats.prefix_cache_hit_tokens
            b = [o["token_ids"] for o in llm.generate(second, greedy())]
            assert stats.prefix_cache_hit_tokens - hits >= 5 * BLOCK * len(second), "no prefix-cache hits"
            results[tp] = a + b
        finally:
            llm.shutdown()
    assert not existing(sems), "the events' semaphores outlived the engine"
    prompts = first + second
    want = hf_oracle.greedy(model, prompts, MAX_NEW)
    assert_same_tokens(hf_oracle, model, prompts, results[2], want, "TP=2 vs transformers")
    if 1 in results:
        assert_same_tokens(hf_oracle, model, prompts, results[1], want, "TP=1 vs transformers")
        assert_same_tokens(hf_oracle, model, prompts, results[2], results[1], "TP=2 vs TP=1")


def test_tp2_logprobs_and_penalties_match_tp1(tp_model):
    """Rank 0 alone applies penalties and computes logprobs (from the gathered logits); prompt logprobs need every
    rank in each chunk's gather: with a 320-token step budget the first prefill step holds 300+ prompt positions,
    two logit chunks (layers/logprobs.py PROMPT_CHUNK), the long prompt's rest the next; they equal one rank's."""
    prompts = random_prompts([4, 30, 70], seed=24)
    scored_prompts = random_prompts([5, 40, 300], seed=25)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.5, frequency_penalty=-0.5)
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    results, prompt_results = {}, {}
    for tp in (1, 2):
        llm = make_llm(tp_model, tp, max_num_batched_tokens=320)
        try:
            results[tp] = llm.generate(prompts, params)
            prompt_results[tp] = llm.generate(scored_prompts, scored)
        finally:
            llm.shutdown()
    for one, two in zip(results[1], results[2]):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    for prompt, one, two in zip(scored_prompts, prompt_results[1], prompt_results[2]):
        assert one.prompt_logprobs[0] is None and two.prompt_logprobs[0] is None
        assert len(two.prompt_logprobs) == len(prompt)
        for j, (a, b) in enumerate(zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]), start=1):
            assert prompt[j] in b and list(a) == list(b), (j, list(a), list(b))
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


# --------------------------------------------------------------------------
# failures
# --------------------------------------------------------------------------
def test_worker_killed_mid_run_fails_fast(tp_model):
    llm = make_llm(tp_model, 2)
    try:
        (pid,) = llm.engine.model_runner.worker_pids
        sems = event_semaphores(llm.engine.model_runner)
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        start = time.monotonic()
        killer.start()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
            llm.generate(random_prompts([20, 50, 90], seed=30), greedy(2000))
        elapsed = time.monotonic() - start
        killer.join()
        assert elapsed < 30, f"the engine took {elapsed:.1f} s to notice the dead worker"
        with pytest.raises(TensorParallelError, match="rank 1"):  # and it stays down
            llm.generate([[5, 6, 7]], greedy())
    finally:
        llm.shutdown()
    assert not wait_gone([pid])
    assert not existing(sems)


def test_worker_exception_is_reported_with_its_traceback(tp_model):
    llm = make_llm(tp_model, 2)
    try:
        llm.engine.model_runner.broadcast("explode")
        with pytest.raises(TensorParallelError, match=r"(?s)rank 1 .*exited with status 1.*"
                                                      r"Traceback.*unknown control-plane call 'explode'"):
            llm.generate([[5, 6, 7]], greedy())
    finally:
        llm.shutdown()


def _worker_failing_at_start_up(config, args):
    """Runs in the spawned rank 1 (imported from this module): loading its shard fails after it joined the group."""
    import llmcli.engine.model_runner as model_runner
    from llmcli.parallel.worker import worker_main

    class BrokenRunner:
        def __init__(self, config):
            raise RuntimeError("simulated failure while loading rank 1's shard")

    model_runner.ModelRunner = BrokenRunner
    worker_main(config, args)


def test_worker_failing_at_start_up_is_reported(tp_model, monkeypatch):
    import llmcli.parallel.tp_runner as tp_runner

    monkeypatch.setattr(tp_runner, "worker_main", _worker_failing_at_start_up)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"(?s)rank 1 .*exited with status 1.*simulated failure while"):
        make_llm(tp_model, 2)
    assert time.monotonic() - start < 60


def _run_script(tmp_path: Path, body: str, env_extra: dict | None = None) -> subprocess.Popen:
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(body))
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.Popen([sys.executable, str(script)], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _read_ready(proc: subprocess.Popen, timeout: float = 90.0) -> dict:
    """The script prints 'READY {"pids": ..., "shm": ..., "sems": ...}' once its engine is up."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box or not box[0].startswith("READY "):
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script did not start its engine: {box} {out} {err[-3000:]}")
    return json.loads(box[0][len("READY "):])


def _finish(proc: subprocess.Popen, timeout: float, what: str) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what} did not end the script within {timeout:.0f} s")


def _assert_released(ready: dict, what: str) -> None:
    """The script's workers, segment and event semaphores are gone (allowing a few seconds for the tracker)."""
    assert not wait_gone(ready["pids"]), f"a worker outlived {what}"
    names = [ready["shm"]] + ready["sems"]
    deadline = time.monotonic() + 10
    while existing(names) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not existing(names), f"left behind in /dev/shm after {what}: {existing(names)}"


SCRIPT_HEAD = """
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    from llmcli import LLM, SamplingParams
    from test_tensor_parallel import event_semaphores

    if __name__ == "__main__":
        llm = LLM({model!r}, device="cpu", dtype="float32", tensor_parallel_size=2, kvcache_block_size=16,
                  num_kvcache_blocks=256, max_num_batched_tokens=48, enforce_eager=True)
        runner = llm.engine.model_runner
        info = dict(pids=runner.worker_pids, shm=runner.shm_name, sems=event_semaphores(runner))
        print("READY", json.dumps(info), flush=True)
"""


def test_ctrl_c_between_calls_with_a_stuck_group_close_exits_130(tmp_path, tp_model):
    """A Ctrl-C that lands in rank 0's own host code (scheduling, reading tokens back), not inside a call to the
    ranks, still ends a process whose group close got stuck with the shell's status for Ctrl-C (CI saw 1)."""
    proc = _run_script(tmp_path, SCRIPT_HEAD.format(model=str(tp_model)) + """
        import llmcli.parallel.tp_group as tp_group
        tp_group.close_process_group = lambda timeout_s: False  # as if the abort were still running
        raise KeyboardInterrupt  # where a terminal's Ctrl-C lands between two calls
    """)
    ready = _read_ready(proc)
    out, err = _finish(proc, 60, "KeyboardInterrupt")
    assert proc.returncode == 130, (proc.returncode, out, err[-2000:])
    _assert_released(ready, "KeyboardInterrupt")


def test_ctrl_c_tears_every_rank_down(tmp_path, tp_model):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does) during generate."""
    proc = _run_script(tmp_path, SCRIPT_HEAD.format(model=str(tp_model)) + """
        for _ in range(10_000):  # generates until the signal lands, however fast or loaded the machine
            llm.generate([[5] * 40, [6] * 70], SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True))
        print("FINISHED", flush=True)
    """)
    ready = _read_ready(proc)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = _finish(proc, 30, "Ctrl-C")
    assert proc.returncode != 0 and "FINISHED" not in out, (proc.returncode, out, err[-2000:])
    assert "KeyboardInterrupt" in err, err[-2000:]
    _assert_released(ready, "Ctrl-C")


def test_a_stuck_group_close_still_ends_the_process(tmp_path, tp_model):
    """Where leaving the process group does not finish (NCCL's abort after a Ctrl-C on two H200s), the process
    still ends at once, with the shell's status for Ctrl-C, and releases every worker and the segment."""
    proc = _run_script(tmp_path, SCRIPT_HEAD.format(model=str(tp_model)) + """
        import llmcli.parallel.tp_group as tp_group
        tp_group.close_process_group = lambda timeout_s: False  # as if the abort were still running
        for _ in range(10_000):  # generates until the signal lands, however fast or loaded the machine
            llm.generate([[5] * 40, [6] * 70], SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True))
        print("FINISHED", flush=True)
    """)
    ready = _read_ready(proc)
    time.sleep(1.0)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = _finish(proc, 60, "Ctrl-C")
    # "at once" next to the hang this guards against (a process that never ends), with room for a loaded
    # 2-core CI machine (26 s seen under CPU stress)
    assert time.monotonic() - start < 40
    assert proc.returncode == 130 and "FINISHED" not in out, (proc.returncode, out, err[-2000:])
    assert "KeyboardInterrupt" in err and "did not close within" in err, err[-2000:]
    _assert_released(ready, "Ctrl-C with a stuck process-group close")


def test_rank0_stuck_in_a_collective_exits_the_process(tmp_path, tp_model):
    """Where a dead peer does not make rank 0's collective fail (NCCL), the watchdog ends the process."""
    proc = _run_script(tmp_path, SCRIPT_HEAD.format(model=str(tp_model)) + """
        with runner._group.call("a simulated collective"):
            os.kill(runner.worker_pids[0], 9)
            time.sleep(120)
        print("RETURNED", flush=True)
    """, {"LLMCLI_TP_EXIT_GRACE_S": "2"})
    ready = _read_ready(proc)
    start = time.monotonic()
    out, err = _finish(proc, 30, "the watchdog")
    assert time.monotonic() - start < 15
    assert proc.returncode == 1 and "RETURNED" not in out, (proc.returncode, out, err[-2000:])
    assert "rank 1" in err and "SIGKILL" in err and "still blocked in 'a simulated collective'" in err, err[-2000:]
    _assert_released(ready, "the watchdog's exit")


def test_killed_main_process_leaves_no_worker_or_segment(tmp_path, tp_model):
    """SIGKILL of rank 0's process (no Python clean-up at all): the orphaned worker leaves and removes the segment."""
    proc = _run_script(tmp_path, SCRIPT_HEAD.format(model=str(tp_model)) + """
        for _ in range(10_000):  # generates until the kill lands, however fast or loaded the machine
            llm.generate([[5] * 40], SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True))
    """)
    ready = _read_ready(proc)
    time.sleep(0.5)
    proc.kill()
    _finish(proc, 30, "SIGKILL")
    _assert_released(ready, "SIGKILL of the main process")
