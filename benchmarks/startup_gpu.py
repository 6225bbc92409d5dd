#!/usr/bin/env python
"""Engine start-up from process start (issue 12: Qwen3-0.6B <= 10 s warm, <= 20 s fresh; Qwen3-8B <= 15 s warm).

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.harness.cli_process import run_child  # noqa: E402

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp", "torch.distributed.tensor",
         "torch.onnx", "transformers.generation.utils", "transformers.modeling_utils", "sklearn")
CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
from llmcli import LLM
t1 = time.perf_counter()
args = json.loads(sys.argv[1])
llm = LLM(args["model"], **args["engine"])
ready = time.time()
t2 = time.perf_counter()
runner = getattr(llm.engine, "model_runner", None)
graphs = getattr(runner, "graphs", None)
print("RESULT " + json.dumps(dict(ready_epoch=ready, import_s=t1 - t0, llm_s=t2 - t1, phases=llm.engine.startup_s,
                                  graphs=len(graphs.batch_sizes) if graphs is not None else 0,
                                  heavy=[m for m in args["heavy"] if m in sys.modules])), flush=True)
llm.shutdown()
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the bundled tiny model, one run each")
    ap.add_argument("--runs", default="0.6B:3,0.6B+cold:1,0.6B+cold+serial:1,8B:2",
                    help="MODEL[@GRAPH_SIZES][+cold][+serial]:COUNT,... (MODEL: a folder under configs/ without "
                         "'Qwen3-', or a path)")
    args = ap.parse_args()
    engine: dict = {"load_format": "dummy"}
    if args.smoke:
        engine.update(device="cpu", num_kvcache_blocks=64)
        args.runs = "tiny:1,tiny+cold+serial:1"
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="llmcli-startup-"))
    for item in args.runs.split(","):
        spec, count = item.rsplit(":", 1)
        spec, *flags = spec.split("+")
        name, _, sizes = spec.partition("@")
        model = (str(REPO / "examples" / "tiny-qwen3") if name == "tiny" else
                 name if "/" in name else str(REPO / "configs" / f"Qwen3-{name}"))
        env = {"LLMCLI_GRAPH_SIZES": sizes} if sizes else {}
        if "serial" in flags:
            env["LLMCLI_SIDE_COMPILE"] = "0"
        tag = name + (f"@{sizes}" if sizes else "") + "".join("+" + f for f in flags)
        for i in range(1, int(count) + 1):
            if "cold" in flags:
                fresh = Path(tempfile.mkdtemp(dir=scratch))
                env.update(TRITON_CACHE_DIR=str(fresh / "triton"), TORCHINDUCTOR_CACHE_DIR=str(fresh / "inductor"))
            r = run_child(CHILD, dict(model=model, engine=engine, heavy=HEAVY), env, timeout_s=600)
            label = f"{tag} #{i}"
            rows.append((label, r))
            print(f"[{label}] ready {r['from_launch_s']:.1f} s after launch (imports {r['import_s']:.1f} s, LLM() "
                  f"{r['llm_s']:.1f} s); phases {r['phases']}; {r['graphs']} graphs; heavy modules: "
                  f"{', '.join(r['heavy']) or 'none'}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print("\nrun                      | from launch | imports | LLM() | probe | compile | graphs (n)  | weights")
    for label, r in rows:
        p = r["phases"]
        print(f"{label:<24.24} | {r['from_launch_s']:10.1f}s | {r['import_s']:6.1f}s | {r['llm_s']:4.1f}s | "
              f"{p.get('probe', 0):4.1f}s | {p.get('compile', 0):6.1f}s | {p.get('graphs', 0):5.1f}s ({r['graphs']:2d}) | "
              f"{p.get('weights', 0):.1f}s")


if __name__ == "__main__":
    main()
