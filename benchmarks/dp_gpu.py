"""Data parallelism on GPUs (issue #17): ``llmcli generate`` with replicas, on the default workload as JSONL.

Every run is the real command (``llmcli generate IN -o OUT --load-format dummy --include-token-ids``, with
the ``llmcli`` logger at INFO so that each replica's pid, GPUs and share of the work are on stderr), while
``nvidia-smi`` is sampled for each GPU's memory and each process's. Parts (``--parts``; the default
depends on how many GPUs are visible):

- ``one-gpu`` (the default with one GPU): the plain engine, then ``-dp 1`` through the data-parallel pool
  (``LLMCLI_DP_FORCE_POOL=1``: the replica is a process of its own behind the driver), on Qwen3-0.6B;
  then ``-dp`` (GPUs + 1) must stop at once with exit status 2.
- ``dp``: DP=1 (plain engine) vs DP=2 for each of ``--models``.
- ``kill``: DP=2, one replica SIGKILLed once an eighth of the records are written: every record exactly
  once, the same answers as DP=1, no process left, every GPU's memory back where it started.
- ``tp-vs-dp``: DP=2 x TP=1 vs DP=1 x TP=2 on the last of ``--models``.
- ``ray``: DP=2 with ``--distributed-backend ray`` (a local Ray instance the command starts), if Ray imports.
- ``too-many``: the ``-dp`` (GPUs + 1) check alone.

On two or more GPUs the default is ``dp kill tp-vs-dp ray too-many``. ``--device cpu --tiny`` runs the same
on the CPU with a tiny random Qwen3 (a smoke test of this script; say ``--parts`` to pick). Prints one
results table last; writes ``$OUT/dp.json`` when OUT is set.

    python benchmarks/dp_gpu.py                              # one H200: the one-gpu part (~2 min)
    python benchmarks/dp_gpu.py                              # two H200s: the matrix of issue #17
    python benchmarks/dp_gpu.py --device cpu --tiny --parts one-gpu dp kill too-many
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from benchmarks.harness.gpu_watch import GpuWatch, gpu_memory_mib  # noqa: E402
from benchmarks.harness.workload import TINY_CONFIG, add_workload_args, make_workload, model_facts  # noqa: E402
from processes import children_of, env, wait_gone  # noqa: E402

# The command line of ``llmcli``, with the llmcli logger at INFO on stderr (the CLI itself shows warnings only).
CLI = ("import logging, sys\n"
       "handler = logging.StreamHandler()\n"
       "handler.setFormatter(logging.Formatter('llmcli log %(levelname)s: %(message)s'))\n"
       "logger = logging.getLogger('llmcli'); logger.addHandler(handler); logger.setLevel(logging.INFO)\n"
       "sys.argv[0] = 'llmcli'\n"
       "from llmcli.cli.app import main\n"
       "main()\n")
ALL_PARTS = ("one-gpu", "dp", "kill", "tp-vs-dp", "ray", "too-many")


# -- processes ------------------------------------------------------------------------------------
def started_at(pid: int) -> int:
    """Start time of a process in clock ticks since boot (orders the replicas as they were spawned)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def descendants(pid: int) -> dict[int, int]:
    """Live descendants of ``pid``, each with its parent (the driver's children are its replicas; theirs,
    a replica's tensor-parallel ranks)."""
    found: dict[int, int] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child in children_of(parent):
            found[child] = parent
            frontier.append(child)
    return found


def replica_rows(stderr: str, watch: GpuWatch, seen: dict[int, int], driver: int) -> list[dict[str, Any]]:
    """Who was on which GPU: each replica's pid and GPUs from the driver's log, memory from nvidia-smi (when
    the pids it reports are ours: in a container they may be the host's)."""
    def on_gpu(pid: int) -> str:
        return "GPU {}: {:,} MiB".format(*watch.pid_peak[pid]) if pid in watch.pid_peak else "n/a"

    rows: list[dict[str, Any]] = []
    for match in re.finditer(r"data-parallel replica (\d+): pid (\d+) on (\S+), (\w+)(?: \(GPUs ([^)]*)\))?",
                             stderr):
        pid = int(match.group(2))
        rows.append({"replica": int(match.group(1)), "pid": pid, "device": match.group(4), "gpus": match.group(5),
                     "nvidia_smi": on_gpu(pid),
                     "tp_ranks": {str(p): on_gpu(p) for p, parent in seen.items() if parent == pid}})
    if driver in watch.pid_peak:
        rows.append({"replica": "driver", "pid": driver, "nvidia_smi": on_gpu(driver)})
    return rows


# -- one run of llmcli generate --------------------------------------------------------------------
@dataclass
class Run:
    label: str
    model: str
    dp: int
    tp: int
    backend: str
    flags: list[str]
    exit_status: int | None = None
    seconds: float = 0.0
    generation_s: float | None = None
    records: int = 0
    expected: int = 0
    exactly_once: bool = False
    output_tokens: int = 0
    tok_s: float | None = None
    identical: str = "n/a"
    replicas: list[dict[str, Any]] = field(default_factory=list)
    replica_work: list[str] = field(default_factory=list)
    gpus: dict[str, dict[str, int]] = field(default_factory=dict)
    processes_left: list[int] = field(default_factory=list)
    gpu_mib_left: dict[str, int] = field(default_factory=dict)
    killed: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    stderr_tail: str = ""


def summary_value(stderr: str, name: str) -> float | None:
    """A number from the CLI's summary table (e.g. ``generation time``)."""
    match = re.search(rf"{re.escape(name)}\s*\S\s*([\d,.]+)", stderr)
    return float(match.group(1).replace(",", "")) if match else None


def read_outputs(out: Path) -> dict[int, list[int]]:
    answers: dict[int, list[int]] = {}
    if not out.exists():
        return answers
    for line in out.read_bytes().splitlines():
        record = json.loads(line)
        if record["id"] in answers:
            raise AssertionError(f"record {record['id']} written twice")
        answers[record["id"]] = record.get("token_ids") or []
    return answers


def generate(label: str, args: argparse.Namespace, model: str, jsonl: Path, folder: Path, *, dp: int = 1,
             tp: int = 1, backend: str = "local", force_pool: bool = False, kill_replica_after: int | None = None,
             device: str | None = None) -> tuple[Run, dict[int, list[int]]]:
    """One ``llmcli generate``; with ``kill_replica_after`` N, SIGKILL the second replica once N lines are out."""
    out = folder / f"{re.sub(r'[^A-Za-z0-9]+', '-', label)}.jsonl"
    flags = ["--load-format", "dummy", "--include-token-ids", "--unordered", "--overwrite",
             "--device", device or args.device, *args.engine_flags]
    if dp > 1 or force_pool or backend != "local":
        flags += ["--data-parallel-size", str(dp)]
    if backend != "local":
        flags += ["--distributed-backend", backend]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
    run = Run(label, Path(model).name, dp, tp, backend, flags)
    run.expected = jsonl.read_bytes().count(b"\n")
    cmd = [sys.executable, "-c", CLI, "generate", str(jsonl), "-o", str(out), "--model", model, *flags]
    run_env = env()  # this checkout importable, no network
    if args.device == "cuda":  # host threads as the user would have them (env() pins one, for the CPU tests)
        run_env.pop("OMP_NUM_THREADS", None)
        if "OMP_NUM_THREADS" in os.environ:
            run_env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if force_pool:
        run_env["LLMCLI_DP_FORCE_POOL"] = "1"
    print(f"-- {label}: llmcli generate ... {' '.join(flags)}" + (" (LLMCLI_DP_FORCE_POOL=1)" if force_pool else ""),
          flush=True)
    before = gpu_memory_mib()
    seen: dict[int, int] = {}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as err, GpuWatch() as watch:
        proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline = start + args.run_timeout
        while proc.poll() is None:
            seen.update(descendants(proc.pid))
            if kill_replica_after is not None and not run.killed and out.exists():
                written = out.read_bytes().count(b"\n")
                replicas = sorted((p for p, parent in seen.items() if parent == proc.pid), key=started_at)
                if written >= kill_replica_after and len(replicas) >= 2:
                    os.kill(replicas[1], signal.SIGKILL)
                    run.killed = {"pid": replicas[1], "lines_written_then": written,
                                  "after_s": round(time.monotonic() - start, 1)}
                    print(f"   SIGKILL to replica pid {replicas[1]} with {written} of {run.expected} records written",
                          flush=True)
            if time.monotonic() > deadline:
                proc.kill()
                run.message = f"no exit within {args.run_timeout:.0f} s (--run-timeout): killed"
                break
            time.sleep(0.1)
        run.exit_status = proc.wait()
        run.seconds = round(time.monotonic() - start, 1)
        err.seek(0)
        stderr = err.read()
    run.processes_left = wait_gone(list(seen), 15)
    time.sleep(1.0 if watch.enabled else 0)  # the driver's CUDA context goes with it; let nvidia-smi see that
    after = gpu_memory_mib()
    run.gpu_mib_left = {g: after[g] - before.get(g, 0) for g in after if after[g] - before.get(g, 0) > 256}
    run.gpus = {g: {"before_mib": before.get(g, 0), "peak_mib": watch.gpu_peak.get(g, 0), "after_mib": after[g]}
                for g in after}
    run.replicas = replica_rows(stderr, watch, seen, proc.pid)
    run.replica_work = re.findall(r"(data-parallel replica \d+(?: \(lost\))?: \d+ requests answered.*)", stderr)
    if run.killed:
        resent = re.search(r"sending its (\d+) unfinished request", stderr)
        run.killed.update(reported="killed by signal SIGKILL" in stderr,
                          resent=int(resent.group(1)) if resent else None)
    answers: dict[int, list[int]] = {}
    try:
        answers = read_outputs(out)
    except (AssertionError, ValueError, KeyError) as exc:
        run.message = run.message or f"bad output: {exc}"
    run.records = len(answers)
    run.exactly_once = sorted(answers) == list(range(run.expected)) and not run.message
    run.output_tokens = sum(len(ids) for ids in answers.values())
    run.generation_s = summary_value(stderr, "generation time")
    if run.generation_s:
        run.tok_s = run.output_tokens / run.generation_s
    if run.exit_status != 0 and not run.message:
        lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("llmcli log")]
        run.message = lines[-1][:300] if lines else f"exit {run.exit_status}"
    run.stderr_tail = stderr[-3000:]
    print(f"   exit {run.exit_status} in {run.seconds} s; {run.records}/{run.expected} records, "
          f"{run.output_tokens:,} tokens, generation {run.generation_s} s"
          + (f"; {run.message}" if run.message else ""), flush=True)
    for r in run.replicas:
        print(f"   {json.dumps(r)}", flush=True)
    for line in run.replica_work:
        print(f"   {line}", flush=True)
    return run, answers


def compare(run: Run, answers: dict[int, list[int]], base: dict[int, list[int]] | None, base_label: str) -> None:
    if run.tp > 1:  # with dummy weights each tensor-parallel rank draws its own shard: another model
        run.identical = "n/a (dummy weights differ at TP>1)"
        return
    if not base:
        return
    same = sum(1 for i, ids in answers.items() if base.get(i) == ids)
    run.identical = f"{same}/{len(base)} vs {base_label}"
    if same < len(base):
        first = sorted(next((k for k, (a, b) in enumerate(zip(ids, base[i])) if a != b), min(len(ids), len(base[i])))
                       for i, ids in answers.items() if i in base and base[i] != ids)
        if first:
            run.identical += f" (differing records part at token {first[0]}..{first[-1]})"


def too_many(args: argparse.Namespace, model: str, jsonl: Path, folder: Path) -> Run:
    """``-dp`` one more than the visible GPUs: exit status 2 before any replica starts. On the CPU (smoke test)
    the command asks for CUDA anyway and must stop the same way, for want of any GPU."""
    visible = args.gpus
    run, _ = generate(f"DP={visible + 1} on {visible} GPU(s)", args, model, jsonl, folder, dp=visible + 1,
                      device="cuda")
    expected = f"needs {visible + 1} GPUs but {visible}" if args.device == "cuda" else "CUDA"
    ok = run.exit_status == 2 and expected in run.stderr_tail and not run.processes_left and run.records == 0
    run.identical = "stops at once: " + ("yes" if ok else "NO")
    return run


# -- the workload ----------------------------------------------------------------------------------
def write_workload(model: str, args: argparse.Namespace, path: Path) -> Path:
    """``llmcli bench``'s default workload (its own generator) as JSONL: token ids, max_tokens, EOS ignored."""
    prompts, outs, _ = make_workload(args, model_facts(Path(model)))
    with path.open("w") as f:
        for ids, n_out in zip(prompts, outs):
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": n_out, "ignore_eos": True,
                                "temperature": args.temperature}) + "\n")
    return path


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=ALL_PARTS, default=None,
                    help="default: one-gpu with one GPU, everything else with two or more")
    ap.add_argument("--models", nargs="+", default=[str(REPO / "configs" / "Qwen3-0.6B"),
                                                    str(REPO / "configs" / "Qwen3-8B")],
                    help="the first runs one-gpu, kill and ray; all run dp; the last runs tp-vs-dp")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 and a small workload (CPU smoke test)")
    add_workload_args(ap)
    ap.add_argument("--engine-args", default="", help="extra llmcli engine flags, one string")
    ap.add_argument("--run-timeout", type=float, default=300, help="seconds per llmcli generate")
    args = ap.parse_args(argv)
    if args.tiny:
        for name, value in (("num_prompts", 16), ("min_input", 8), ("max_input", 32), ("min_output", 16),
                            ("max_output", 48)):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    args.engine_flags = args.engine_args.split()
    if args.device == "cpu":  # a small KV pool, one sequence at a time: runs long enough for a kill to land mid-way
        args.engine_flags = ["--num-kvcache-blocks", "128", "--kvcache-block-size", "16", "--max-num-seqs", "2",
                             *args.engine_flags]
    return args


def visible_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch CUDA: no GPUs
        return 0


def table(runs: list[Run]) -> str:
    lines = ["| run | model | DP x TP | backend | exit | records (exactly once) | output tokens | generation s "
             "| output tok/s | vs DP=1 | identical | GPUs: peak GiB | left: processes, GiB |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    base_rate: dict[str, float] = {}
    for r in runs:
        if r.dp == 1 and r.tp == 1 and r.backend == "local" and r.tok_s and r.model not in base_rate:
            base_rate[r.model] = r.tok_s
    for r in runs:
        ratio = f"{r.tok_s / base_rate[r.model]:.2f}x" if r.tok_s and r.model in base_rate else "n/a"
        peaks = ", ".join(f"{g}: {v['peak_mib'] / 1024:.1f}" for g, v in r.gpus.items()) or "n/a"
        left = f"{len(r.processes_left)}, " + (", ".join(f"GPU {g} +{m / 1024:.1f}" for g, m in r.gpu_mib_left.items())
                                               or "0")
        refused = r.identical.startswith("stops at once")
        records = "none (refused)" if refused and not r.records else \
            f"{r.records}/{r.expected} ({'yes' if r.exactly_once else 'NO'})"
        lines.append(f"| {r.label} | {r.model} | {r.dp} x {r.tp} | {r.backend} | {r.exit_status} | {records} | "
                     f"{r.output_tokens:,} | "
                     f"{r.generation_s if r.generation_s is not None else 'n/a'} | "
                     f"{f'{r.tok_s:,.0f}' if r.tok_s else 'n/a'} | {ratio} | {r.identical} | {peaks} | {left} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = args.gpus = visible_gpu_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        print("no CUDA device visible: use --device cpu --tiny for the smoke test", file=sys.stderr)
        return 2
    parts = args.parts or (["one-gpu"] if args.device == "cuda" and gpus < 2 else
                           ["dp", "kill", "tp-vs-dp", "ray", "too-many"])
    if args.device == "cuda" and gpus < 2:
        skipped = [p for p in parts if p in ("dp", "kill", "tp-vs-dp", "ray")]
        if skipped:
            print(f"only {gpus} GPU visible: skipping {skipped} (they need two)", flush=True)
        parts = [p for p in parts if p not in skipped]
    folder = Path(tempfile.mkdtemp(prefix="llmcli-dp-"))
    models = args.models
    if args.tiny:
        (folder / "Qwen3-tiny").mkdir()
        (folder / "Qwen3-tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
        models = [str(folder / "Qwen3-tiny")]
    print(f"dp_gpu: {gpus} GPU(s) visible, device {args.device}; parts {parts}; models "
          f"{[Path(m).name for m in models]}", flush=True)
    started = time.monotonic()
    runs: list[Run] = []
    workloads = {m: write_workload(m, args, folder / f"{Path(m).name}.jsonl") for m in dict.fromkeys(models)}
    first, last = models[0], models[-1]
    baselines: dict[str, dict[int, list[int]]] = {}

    def plain(model: str) -> dict[int, list[int]]:
        if model not in baselines:
            run, answers = generate(f"DP=1 {Path(model).name}", args, model, workloads[model], folder)
            runs.append(run)
            baselines[model] = answers if run.exactly_once else {}
        return baselines[model]

    try:
        if "one-gpu" in parts:
            base = plain(first)
            run, answers = generate(f"DP=1 via the pool {Path(first).name}", args, first, workloads[first], folder,
                                    force_pool=True)
            compare(run, answers, base, "plain engine")
            runs.append(run)
            if "too-many" not in parts:
                runs.append(too_many(args, first, workloads[first], folder))
        if "dp" in parts:
            for model in models:
                base = plain(model)
                run, answers = generate(f"DP=2 {Path(model).name}", args, model, workloads[model], folder, dp=2)
                compare(run, answers, base, "DP=1")
                runs.append(run)
        if "kill" in parts:
            base = plain(first)
            run, answers = generate(f"DP=2, SIGKILL replica 1 {Path(first).name}", args, first, workloads[first],
                                    folder, dp=2, kill_replica_after=max(1, args.num_prompts // 8))
            compare(run, answers, base, "DP=1")
            if not run.killed:
                run.message = run.message or "the kill did not land (the run ended first)"
            runs.append(run)
        if "tp-vs-dp" in parts:
            plain(last)
            if not any(r.dp == 2 and r.tp == 1 and r.model == Path(last).name and not r.killed for r in runs):
                run, answers = generate(f"DP=2 {Path(last).name}", args, last, workloads[last], folder, dp=2)
                compare(run, answers, baselines.get(last), "DP=1")
                runs.append(run)
            run, answers = generate(f"TP=2 {Path(last).name}", args, last, workloads[last], folder, tp=2)
            compare(run, answers, baselines.get(last), "DP=1")
            runs.append(run)
        if "ray" in parts:
            try:
                import ray  # noqa: F401
            except ImportError:
                print("ray: skipped (Ray is not installed here)", flush=True)
            else:
                base = plain(first)
                run, answers = generate(f"DP=2 Ray {Path(first).name}", args, first, workloads[first], folder, dp=2,
                                        backend="ray")
                compare(run, answers, base, "DP=1")
                runs.append(run)
        if "too-many" in parts:
            runs.append(too_many(args, first, workloads[first], folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        report = {"parts": parts, "gpus": gpus, "seconds": round(time.monotonic() - started, 1),
                  "runs": [asdict(r) for r in runs]}
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "dp.json").write_text(json.dumps(report, indent=1))
    kills = [r for r in runs if r.killed]
    for r in kills:
        print(f"\nkill: {json.dumps(r.killed)}; processes left {r.processes_left}; GPU memory left "
              f"{r.gpu_mib_left or 'none'} (MiB above the start)")
    print(f"\n## Data parallelism ({time.monotonic() - started:.0f} s)\n")
    print(table(runs))
    bad = [r.label for r in runs if (r.exit_status != 0 and not r.identical.startswith("stops at once: yes"))
           or r.identical.endswith("NO") or (r.exit_status == 0 and not r.exactly_once) or r.processes_left
           or (r.killed and not r.killed.get("reported"))]
    print(f"\n{len(bad)} failed run(s){': ' + '; '.join(bad) if bad else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
