"""A stopped tensor-parallel rank on GPUs (issue #14, item 9): is it reported in seconds, and never by mistake?

Two `llmcli generate -tp 2` runs with a short heartbeat limit (``LLMCLI_TP_HEARTBEAT_S``, 5 s here):

* ``clean``: a whole run must finish with exit 0 and no "stopped responding": start-up (weights, CUDA
  graphs, Triton compiles) and long steps must not look like silence;
* ``sigstop``: rank 1 gets SIGSTOP after the first answer; the run must exit 1 within seconds of the
  limit, name the rank, pid and what it was doing, and leave no worker or shared-memory segment.

NCCL collectives with a stopped peer never return, so on GPUs the exit also goes through the watchdog's
grace period (``LLMCLI_TP_EXIT_GRACE_S``, 3 s with NCCL). Needs 2 GPUs (kind nvidia-h200-x2);
``--device cpu`` runs the same on the tiny bundled model with gloo. Prints one table; writes
``$OUT/stopped_rank.json`` when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from processes import child_processes, env, wait_gone  # noqa: E402


def command(args: argparse.Namespace, inp: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "llmcli", "generate", str(inp), "-o", str(out), "-q", "-tp", "2",
           "--max-num-seqs", "16"]
    if args.device == "cpu":
        return cmd + ["--model", str(REPO / "examples" / "tiny-qwen3"), "--device", "cpu"]
    return cmd + ["--model", args.model, "--load-format", "dummy", "--dtype", "bfloat16",
                  "--gpu-memory-utilization", "0.4", "--max-model-len", "4096"]


def one_run(args: argparse.Namespace, case: str, work: Path) -> dict:
    inp, out = work / f"{case}.jsonl", work / f"{case}.out.jsonl"
    with open(inp, "w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"prompt_token_ids": [5 + i] * 64, "max_tokens": args.max_tokens,
                                "ignore_eos": True, "temperature": 0}) + "\n")
    run_env = {**env(), "LLMCLI_TP_HEARTBEAT_S": str(args.limit)}
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command(args, inp, out), env=run_env, stdout=subprocess.DEVNULL, stderr=err)
        workers: list[int] = []
        stopped_at = None
        try:
            if case == "sigstop":
                while not (out.exists() and out.stat().st_size > 0):
                    if proc.poll() is not None or time.monotonic() - started > args.timeout:
                        break
                    time.sleep(0.05)
                workers = [pid for pid, state, cmd in child_processes(proc.pid) if "spawn" in cmd and state != "Z"]
                if proc.poll() is None and workers:
                    os.kill(workers[0], signal.SIGSTOP)
                    stopped_at = time.monotonic()
            else:
                workers = []
            proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            for pid in workers:
                for sig in (signal.SIGCONT, signal.SIGKILL) if hung else ():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ended = time.monotonic()
        err.seek(0)
        text = err.read()
    said = [ln for ln in text.splitlines() if "stopped responding" in ln]
    answered = out.read_bytes().count(b"\n") if out.exists() else 0
    return {"case": case, "exit_status": proc.returncode, "hung": hung, "answered": f"{answered}/{args.prompts}",
            "seconds_after_stop": round(ended - stopped_at, 1) if stopped_at else None,
            "wall_s": round(ended - started, 1), "message": said[0][:240] if said else "",
            "tracebacks": text.count("Traceback"), "workers_left": wait_gone(workers, 15) if workers else [],
            "segments_left": [p.name for p in Path("/dev/shm").glob(f"llmcli_tp_{proc.pid}_*")],
            "stderr_tail": text[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default=str(REPO / "configs" / "Qwen3-0.6B"))
    parser.add_argument("--limit", type=float, default=5.0, help="LLMCLI_TP_HEARTBEAT_S for both runs")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per run")
    args = parser.parse_args()
    if args.device == "cpu":
        args.prompts, args.max_tokens = min(args.prompts, 24), min(args.max_tokens, 48)
    with tempfile.TemporaryDirectory() as work:
        results = [one_run(args, case, Path(work)) for case in ("clean", "sigstop")]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "stopped_rank.json").write_text(json.dumps(results, indent=1))
    clean, stop = results
    ok_clean = clean["exit_status"] == 0 and not clean["message"]
    ok_stop = (stop["exit_status"] == 1 and bool(stop["message"]) and not stop["workers_left"]
               and not stop["segments_left"] and stop["seconds_after_stop"] is not None
               and stop["seconds_after_stop"] < args.limit + 10)
    for r in results:
        if r["exit_status"] not in (0, 1) or r["hung"] or r["tracebacks"]:
            print(f"--- {r['case']} stderr tail ---\n{r['stderr_tail']}")
    print(f"\nstopped tensor-parallel rank, LLMCLI_TP_HEARTBEAT_S={args.limit:g} ({args.device})")
    print(f"{'case':8} {'exit':>4} {'answered':>9} {'after stop':>10} {'wall':>6} {'tracebacks':>10} "
          f"{'left':>5}  verdict")
    for r, ok in ((clean, ok_clean), (stop, ok_stop)):
        after = f"{r['seconds_after_stop']} s" if r["seconds_after_stop"] is not None else "-"
        left = len(r["workers_left"]) + len(r["segments_left"])
        print(f"{r['case']:8} {str(r['exit_status']):>4} {r['answered']:>9} {after:>10} {r['wall_s']:>5}s "
              f"{r['tracebacks']:>10} {left:>5}  {'ok' if ok else 'FAILED'}")
    print(f"message: {stop['message'] or '(none)'}")


if __name__ == "__main__":
    main()
