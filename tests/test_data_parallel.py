"""Data parallelism: many engine replicas behind one input, locally (processes) and through Ray (actors).

What must hold, whatever the number of replicas and whatever dies on the way:
every input answered exactly once, with the same output as one replica (greedy
records, and sampled ones: the driver gives every request without a seed the
seed one engine would have drawn), in input order.

The end-to-end tests run ``python -m llmcli generate`` as a real process (as a
user would); the one-replica output they compare with is computed once per
session. The Ray tests start a small local Ray cluster in this process and
point the command at it with ``--ray-address``; they skip when Ray is not
installed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from llmcli.scaleout.balancer import OutstandingTokenBalancer, request_cost
from llmcli.scaleout.data_parallel import DataParallelEngine, DataParallelError, ScaleOut
from llmcli.scaleout.replica import ReplicaInfo
from llmcli.engine.outputs import EngineStats, RequestOutput
from llmcli.sampling_params import SamplingParams

from processes import children_of, env, wait_for_lines, wait_gone

KILL_RECORDS = 32
KILL_TOKENS = 48


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def command(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmcli", "generate", str(inp), "-o", str(out), "--model", str(model),
            "--device", "cpu", "--num-kvcache-blocks", "256", "--kvcache-block-size", "16", "--temperature", "0",
            "--max-tokens", "8", "--include-token-ids", *extra]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, env=env(), capture_output=True, timeout=timeout)
    assert result.returncode == 0, result.stderr.decode()
    return result


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def lines_of(out: Path) -> list[dict]:
    data = out.read_bytes()
    assert data.endswith(b"\n"), f"torn last line: {data[-80:]!r}"
    return [orjson.loads(line) for line in data.splitlines()]


def mixed_records() -> list[dict]:
    """Greedy records of very different lengths, plus sampled ones with and without their own seed."""
    records = []
    for i in range(14):
        length = 120 if i % 5 == 0 else 3 + i  # a few long prompts, for the balancer to spread
        records.append({"prompt_token_ids": [(7 * i + 11 * k) % 500 + 3 for k in range(length)]})
    records.append({"prompt": "The quick brown fox", "id": "text"})
    records.append({"prompt_token_ids": [5, 6, 7, 8], "temperature": 0.9, "id": "sampled"})  # the driver seeds it
    records.append({"prompt_token_ids": [9, 10, 11], "temperature": 0.9, "seed": 7, "n": 2, "id": "seeded"})
    records.append({"prompt_token_ids": [12, 13], "max_tokens": 3, "stop_token_ids": [99], "id": "short"})
    return records


def kill_records() -> list[dict]:
    """Enough work (32 requests x 48 steps, one sequence at a time per replica) that a kill lands mid-run."""
    return [{"prompt_token_ids": [3 + i, 40 + i, 7, 99], "max_tokens": KILL_TOKENS, "ignore_eos": True}
            for i in range(KILL_RECORDS)]


KILL_FLAGS = ("--max-num-seqs", "1", "-q")


def resent_count(stderr: str) -> int:
    match = re.search(r"data-parallel replica \d+ .*sending its (\d+) unfinished request", stderr, re.S)
    assert match, f"no failover reported on stderr:\n{stderr}"
    return int(match.group(1))


# --------------------------------------------------------------------------
# the one-replica answers every test compares with
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("dp_inputs")
    return {"mixed": write_jsonl(folder / "mixed.jsonl", mixed_records()),
            "kill": write_jsonl(folder / "kill.jsonl", kill_records())}


@pytest.fixture(scope="module")
def one_replica(tiny_model, inputs, tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("dp_baseline")
    run(command(tiny_model, inputs["mixed"], folder / "mixed.jsonl", "-q"))
    run(command(tiny_model, inputs["kill"], folder / "kill.jsonl", *KILL_FLAGS))
    return {"mixed": lines_of(folder / "mixed.jsonl"), "kill": lines_of(folder / "kill.jsonl")}


# --------------------------------------------------------------------------
# balancing (no processes)
# --------------------------------------------------------------------------
def test_request_cost_counts_prompt_and_room_to_generate():
    assert request_cost(100, SamplingParams(max_tokens=20), 4096) == 120
    assert request_cost(100, SamplingParams(max_tokens=None), 512) == 512  # no max_tokens: up to max_model_len
    assert request_cost(500, SamplingParams(max_tokens=64), 512) == 512  # bounded by max_model_len


def test_balancer_spreads_long_prompts_by_tokens_not_requests():
    b = OutstandingTokenBalancer(3)
    # three long prompts first: one on each replica, not all three on replica 0
    assert [b.assign(f"long{i}", 1000) for i in range(3)] == [0, 1, 2]
    # many short ones then fill evenly; a count-based balancer would give the same number to each
    for i in range(30):
        b.assign(f"short{i}", 10)
    assert b.load == [1100, 1100, 1100]
    # replica 1 finishes its long prompt: the next requests all go there until it catches up
    b.done("long1")
    assert [b.assign(f"next{i}", 250) for i in range(4)] == [1, 1, 1, 1]
    assert b.load == [1100, 1100, 1100]
    # a long request never lands where a long one is already running if another replica is lighter
    b2 = OutstandingTokenBalancer(2)
    b2.assign("a", 4000)
    picks = [b2.assign(f"s{i}", 100) for i in range(10)]
    assert picks == [1] * 10  # 1000 tokens on replica 1 are still fewer than 4000 on replica 0
    assert b2.count == [1, 10]


def test_balancer_gives_back_a_lost_replicas_requests_in_order():
    b = OutstandingTokenBalancer(2)
    for i in range(6):
        b.assign(i, 10)
    b.done(2)
    assert b.remove(0) == [0, 4]  # replica 0 held 0, 2, 4; 2 was answered
    assert b.live == [1] and b.load == [0, 30]
    assert [b.assign(i, 10) for i in (0, 4)] == [1, 1]  # only replica 1 takes requests now
    b.remove(1)
    with pytest.raises(RuntimeError):
        b.pick()


# --------------------------------------------------------------------------
# the driver's bookkeeping, with a scripted pool (no processes)
# --------------------------------------------------------------------------
class ScriptedPool:
    """A pool whose replicas answer only when the test says so."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent: dict[int, list] = {r: [] for r in range(size)}
        self.events: list[tuple] = []
        self.killed: list[int] = []
        self.closed = False

    def start(self, timeout_s):
        return [ReplicaInfo(r, 1000 + r, "here", "cpu", 64 + r, None) for r in range(self.size)]

    def submit(self, index, batch):
        self.sent[index].extend(batch)

    def wait(self, timeout):
        events, self.events = self.events, []
        return events

    def kill(self, index):
        self.killed.append(index)

    def shutdown(self):
        self.closed = True


def answer(request_id) -> RequestOutput:
    return RequestOutput.single(request_id=request_id, prompt_token_ids=[1], token_ids=[2], text="x", finish_reason="length")


def test_failover_resends_unanswered_requests_and_drops_duplicates(tiny_model):
    from llmcli.config import Config

    config = Config(str(tiny_model), device="cpu")
    pool = ScriptedPool(2)
    engine = DataParallelEngine(config, ScaleOut(2), tokenizer=object(), pool=pool)
    assert engine.model_runner.num_blocks == 64  # the smallest pool decides what fits
    for i in range(6):
        engine.add_request([5, 6, 7], SamplingParams(temperature=0.9, max_tokens=4), request_id=i)
    assert engine.step() == []
    first = {r: [item[0] for item in batch] for r, batch in pool.sent.items()}
    assert sorted(first[0] + first[1]) == list(range(6)) and first[0] and first[1]
    seeds = [item[2].seed for r in (0, 1) for item in pool.sent[r]]
    assert all(s is not None for s in seeds) and len(set(seeds)) == 6  # seeded by the driver, once each

    # replica 0 answers one request, then dies; its answer arrives before the loss is seen
    done_by_0 = first[0][0]
    pool.events = [("out", 0, [answer(done_by_0)], EngineStats(generated_tokens=5, num_running=2)),
                   ("lost", 0, "(pid 1000) was killed by signal SIGKILL")]
    got = engine.step()
    assert [o.request_id for o in got] == [done_by_0]
    assert pool.killed == [0]
    resent = [item[0] for item in pool.sent[1][len(first[1]):]]
    assert resent == first[0][1:]  # its unanswered requests, in order, to the survivor
    # a resent request keeps its seed: same output wherever it runs
    seed_of = {item[0]: item[2].seed for item in pool.sent[0] + pool.sent[1][:len(first[1])]}
    assert all(item[2].seed == seed_of[item[0]] for item in pool.sent[1][len(first[1]):])
    assert engine.stats.generated_tokens == 5 and engine.stats.num_running == 0  # a lost replica runs nothing

    # replica 1 answers everything, one request twice (and the answered one again): each reaches the caller once
    rest = [i for i in range(6) if i != done_by_0]
    pool.events = [("out", 1, [answer(i) for i in rest] + [answer(rest[0]), answer(done_by_0)],
                    EngineStats(generated_tokens=20))]
    got = engine.step()
    assert sorted(o.request_id for o in got) == rest
    assert not engine.has_unfinished()
    assert engine.stats.generated_tokens == 25  # counters summed over the replicas, the lost one's included

    engine.add_request([5], SamplingParams(max_tokens=2), request_id="last")
    engine.step()
    pool.events = [("lost", 1, "(pid 1001) exited with status 1")]
    with pytest.raises(DataParallelError, match="every data-parallel replica has been lost"):
        engine.step()
    engine.shutdown()
    assert pool.closed


def test_unseeded_requests_get_the_seeds_one_engine_would_draw(tiny_model):
    import random

    from llmcli.config import Config

    config = Config(str(tiny_model), device="cpu", seed=3)
    pool = ScriptedPool(3)
    engine = DataParallelEngine(config, ScaleOut(3), tokenizer=object(), pool=pool)
    for i in range(5):
        engine.add_request([1, 2], SamplingParams(seed=100 if i == 2 else None), request_id=i)
    engine.step()
    got = {item[0]: item[2].seed for r in range(3) for item in pool.sent[r]}
    rng = random.Random(3)  # LLMEngine's draw: random.Random(config.seed).getrandbits(63) per unseeded request
    want = {i: 100 if i == 2 else rng.getrandbits(63) for i in range(5)}
    assert got == want
    engine.shutdown()


# --------------------------------------------------------------------------
# the command line: options
# --------------------------------------------------------------------------
def test_ray_backend_without_ray_says_how_to_install(tiny_model, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import llmcli.scaleout.ray_pool as dp_ray
    from llmcli.cli.app import app

    monkeypatch.setattr(dp_ray, "ray_available", lambda: False)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2]}])
    args = ["generate", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_model), "--device", "cpu"]
    runner = CliRunner()
    for extra in (["--distributed-backend", "ray"], ["--ray-address", "auto"]):
        result = runner.invoke(app, args + extra)
        assert result.exit_code == 2, result.output
        assert "pip install 'llmcli[ray]'" in result.output
    result = runner.invoke(app, args + ["--distributed-backend", "local", "--ray-address", "auto"])
    assert result.exit_code == 2 and "--ray-address" in result.output
    result = runner.invoke(app, args + ["--data-parallel-size", "0"])
    assert result.exit_code == 2
    assert not (tmp_path / "out.jsonl").exists()


# --------------------------------------------------------------------------
# local replicas (processes on this machine)
# --------------------------------------------------------------------------
def test_two_local_replicas_match_one(tiny_model, inputs, one_replica, tmp_path):
    out = tmp_path / "out.jsonl"
    result = run(command(tiny_model, inputs["mixed"], out, "--data-parallel-size", "2"))
    got = lines_of(out)
    assert [line["id"] for line in got] == [line["id"] for line in one_replica["mixed"]]  # input order
    assert got == one_replica["mixed"]  # text, token ids, finish_reason, usage: all identical
    assert b"18 / 18" in result.stderr  # the summary counts every record once


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_logprobs_and_penalties_travel_from_replicas(tiny_checkpoint, tmp_path, family):
    """Replicas ship vLLM-shaped outputs (logprobs built in the replica before pickling) to the driver; on
    Qwen2 too (another family in the replicas' processes)."""
    tiny_model = tiny_checkpoint(family)
    records = [{"id": i, "prompt_token_ids": [5 + i, 17, 42, 99][: 2 + i % 3], "logprobs": 2, "prompt_logprobs": 1,
                "repetition_penalty": 1.3, "presence_penalty": -1.0} for i in range(6)]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    run(command(tiny_model, inp, one))
    run(command(tiny_model, inp, two, "--data-parallel-size", "2"))
    got, want = lines_of(two), lines_of(one)
    assert [line["token_ids"] for line in got] == [line["token_ids"] for line in want]
    for a, b in zip(got, want):
        assert len(a["logprobs"]) == len(a["token_ids"]) and len(a["prompt_logprobs"]) == len(records[a["id"]][
            "prompt_token_ids"])
        assert [e["token_id"] for e in a["logprobs"]] == a["token_ids"]
        assert [e["logprob"] for e in a["logprobs"]] == pytest.approx([e["logprob"] for e in b["logprobs"]],
                                                                        abs=1e-5)


def hit_a_replica_mid_run(model: Path, inp: Path, out: Path, sig: int, **extra_env: str) -> tuple[str, list[int]]:
    """A -dp 2 run whose first replica gets ``sig`` once OUT has a line; (its stderr, the replica pids)."""
    proc = subprocess.Popen(command(model, inp, out, *KILL_FLAGS, "-dp", "2"), env={**env(), **extra_env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_lines(proc, out, 1)
        replicas = children_of(proc.pid)
        assert len(replicas) == 2, replicas
        os.kill(replicas[0], sig)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.stderr.read().decode(), replicas


def test_local_replica_killed_mid_run_loses_nothing(tiny_model, inputs, one_replica, tmp_path):
    out = tmp_path / "out.jsonl"
    stderr, replicas = hit_a_replica_mid_run(tiny_model, inputs["kill"], out, signal.SIGKILL)
    assert "killed by signal SIGKILL" in stderr
    assert resent_count(stderr) >= 1
    assert lines_of(out) == one_replica["kill"]  # every input exactly once, same answers, in order
    assert not wait_gone(replicas), "a replica outlived the run"


def test_resume_after_the_driver_is_killed(tiny_model, inputs, one_replica, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = command(tiny_model, inputs["kill"], out, *KILL_FLAGS, "-dp", "2")
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_lines(proc, out, 1)
    replicas = children_of(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(replicas) == 2
    assert not wait_gone(replicas), "replicas must leave by themselves when the driver is killed"
    done = lines_of(out)
    assert 1 <= len(done) < KILL_RECORDS, "the kill should land mid-way"

    result = run([c for c in cmd if c != "-q"] + ["--resume"])
    assert f"{KILL_RECORDS - len(done)} records to run" in result.stderr.decode()
    lines = lines_of(out)
    assert sorted(line["id"] for line in lines) == list(range(KILL_RECORDS))  # each input exactly once
    want = {line["id"]: line for line in one_replica["kill"]}
    assert all(line == want[line["id"]] for line in lines)


def test_one_replica_runs_through_the_pool_when_forced(tiny_model, inputs, one_replica, tmp_path):
    # LLMCLI_DP_FORCE_POOL=1: -dp 1 as a replica process behind the driver (the GPU check of one H200 uses this)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(tiny_model, inputs["kill"], out, *KILL_FLAGS, "-dp", "1"),
                            env={**env(), "LLMCLI_DP_FORCE_POOL": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for_lines(proc, out, 1)
        replicas = children_of(proc.pid)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(replicas) == 1, replicas
    assert lines_of(out) == one_replica["kill"]
    assert not wait_gone(replicas), "the replica outlived the run"


# --------------------------------------------------------------------------
# Ray: a local cluster started here, replicas as actors
# --------------------------------------------------------------------------
def ray_processes() -> set[int]:
    """Pids of Ray's own daemons (GCS server, raylet) on this machine."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                name = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if name in ("gcs_server", "raylet"):
                found.add(int(entry))
    return found


def test_ray_backend_starts_and_stops_its_own_ray(tiny_model, inputs, one_replica, tmp_path):
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    before = ray_processes()
    out = tmp_path / "out.jsonl"
    run(command(tiny_model, inputs["mixed"], out, "-q", "--distributed-backend", "ray", "-dp", "2"))
    assert lines_of(out) == one_replica["mixed"]
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes() - before, "the Ray instance the run started outlived it"


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        yield ray, ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def our_actors(ray) -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("llmcli-dp-")]


def test_ray_two_replicas_match_one(tiny_model, inputs, one_replica, ray_cluster, tmp_path):
    ray, address = ray_cluster
    out = tmp_path / "out.jsonl"
    run(command(tiny_model, inputs["mixed"], out, "-q", "--data-parallel-size", "2", "--ray-address", address))
    assert lines_of(out) == one_replica["mixed"]
    deadline = time.monotonic() + 30
    while our_actors(ray) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not our_actors(ray), "the run's actors outlived it"


def test_ray_cluster_without_the_gpus_asked_for_stops_at_once(tiny_model, inputs, ray_cluster, tmp_path):
    ray, address = ray_cluster  # CPUs only
    out = tmp_path / "out.jsonl"
    cmd = command(tiny_model, inputs["mixed"], out, "-q", "-dp", "2", "--ray-address", address)
    cmd[cmd.index("--device") + 1] = "cuda"
    result = subprocess.run(cmd, env=env(), capture_output=True, timeout=120)
    assert result.returncode == 2, result.stderr.decode()
    assert "needs 2 GPUs on the Ray cluster" in result.stderr.decode()
    assert not our_actors(ray) and not out.exists()


def test_ray_actor_killed_mid_run_loses_nothing(tiny_model, inputs, one_replica, ray_cluster, tmp_path):
    ray, address = ray_cluster
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(tiny_model, inputs["kill"], out, *KILL_FLAGS, "-dp", "2", "--ray-address", address),
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_lines(proc, out, 1)
        actors = our_actors(ray)
        assert len(actors) == 2, actors
        victim = sorted(actors, key=lambda a: a["name"])[1]
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read().decode()
    assert "replica1" in stderr
    assert resent_count(stderr) >= 1
    assert lines_of(out) == one_replica["kill"]


def three_scripted_replicas(model, requests: int) -> tuple[DataParallelEngine, ScriptedPool]:
    """A driver over three scripted replicas, ``requests`` requests sent to them."""
    from llmcli.config import Config

    pool = ScriptedPool(3)
    engine = DataParallelEngine(Config(str(model), device="cpu"), ScaleOut(3), tokenizer=object(), pool=pool)
    for i in range(requests):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), request_id=i)
    engine.step()
    return engine, pool


def test_a_request_whose_replicas_keep_failing_fails_alone(tiny_model):
    engine, pool = three_scripted_replicas(tiny_model, 9)
    on = {r: [item[0] for item in pool.sent[r]] for r in range(3)}
    poison, neighbour = on[0][0], on[0][1]

    def where(request_id):
        return next(r for r in range(3) if request_id in [item[0] for item in pool.sent[r]] and r not in pool.killed)

    # replica 0's engine fails while running the poison and a neighbour: both move on, nothing fails yet
    pool.events = [("lost", 0, "(pid 1000) exited with status 1; its error: boom", [poison, neighbour])]
    assert engine.step() == []
    second = where(poison)
    # the replica it moved to fails too, running it and a request that never failed before
    innocent = next(rid for rid in on[second] if rid not in (poison, neighbour))
    pool.events = [("lost", second, "(pid 1001) exited with status 1; its error: boom", [poison, innocent])]
    got = engine.step()
    assert [o.request_id for o in got] == [poison]  # given up on, as an error output, not sent to the third
    assert "running on 2 data-parallel replicas" in got[0].error and "not sent to another" in got[0].error
    third = 3 - 0 - second
    moved = [item[0] for item in pool.sent[third]]
    assert poison not in moved and innocent in moved and neighbour in moved  # the others are still answered
    assert engine.has_unfinished()
    engine.shutdown()


def test_a_stopped_replica_blames_nobody_and_a_lone_runner_fails_at_once(tiny_model):
    engine, pool = three_scripted_replicas(tiny_model, 6)
    on0 = [item[0] for item in pool.sent[0]]
    pool.events = [("lost", 0, "(pid 1000) stopped responding: no heartbeat", [])]
    assert engine.step() == []  # silent, not failing on a request: all of its requests move on
    on1 = [item[0] for item in pool.sent[1]]
    pool.events = [("lost", 1, "(pid 1001) exited with status 1; its error: boom", [on1[0]])]
    got = engine.step()
    assert [o.request_id for o in got] == [on1[0]] and "the only request" in got[0].error
    assert sorted(item[0] for item in pool.sent[2]) == sorted(set(range(6)) - {on1[0]})
    assert set(on0) <= {item[0] for item in pool.sent[2]}
    engine.shutdown()


def test_local_replica_stopped_mid_run_is_lost_and_its_requests_resent(tiny_model, inputs, one_replica, tmp_path):
    out = tmp_path / "out.jsonl"
    # frozen, not dead: only its silence tells
    stderr, replicas = hit_a_replica_mid_run(tiny_model, inputs["kill"], out, signal.SIGSTOP, LLMCLI_DP_HEARTBEAT_S="2")
    assert "stopped responding: no heartbeat for" in stderr and "LLMCLI_DP_HEARTBEAT_S=2" in stderr
    assert resent_count(stderr) >= 1
    assert lines_of(out) == one_replica["kill"]
    assert not wait_gone(replicas), "the stopped replica outlived the run"
