"""The whole job, not just the engine: `llmcli generate` wall time against the engine alone, in one GPU run.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]
from benchmarks.harness.cli_process import run_child  # noqa: E402
from benchmarks.harness.workload import write_requests_jsonl  # noqa: E402
from llmcli.cli.bench import Workload, make_requests  # noqa: E402
from synth_tokenizer import vocabulary, words, write_model_dir  # noqa: E402

# Prompt words per record: the synthetic tokenizer spends ~3.3 tokens a word, so this range gives the issue's
# ~570 prompt tokens a record (11.4 M for 20,000 records of 60-160 words of real text with Qwen3's tokenizer).
LABEL_WORDS = (95, 250)
API = r'''
import json, sys, time
t0 = time.perf_counter()
from llmcli import LLM, SamplingParams
from llmcli.engine.prompt_encoding import encode_texts
args = json.loads(sys.argv[1])
records = [json.loads(l) for l in open(args["input"])]
start = time.perf_counter()
llm = LLM(args["model"], **args["engine"])
startup = time.perf_counter() - start
ready_epoch = time.time()
tok_start = time.perf_counter()
if "prompt" in records[0]:
    ids = encode_texts(llm.tokenizer, [r["prompt"] for r in records])  # as the CLI encodes plain prompts
else:
    ids = [r["prompt_token_ids"] for r in records]
tokenize = time.perf_counter() - tok_start
sampling = args["sampling"]
params = [SamplingParams(**{**sampling, **{k: r[k] for k in ("max_tokens", "temperature", "ignore_eos") if k in r}})
          for r in records]
gen_start = time.perf_counter()
outs = llm.generate(ids, params)
generate = time.perf_counter() - gen_start
llm.shutdown()
print("RESULT " + json.dumps(dict(import_s=start - t0, startup_s=startup, ready_epoch=ready_epoch, tokenize_s=tokenize, generate_s=generate,
                                  prompt_tokens=sum(map(len, ids)), generated=sum(len(o.token_ids) for o in outs),
                                  phases=llm.engine.startup_s)))
'''


def write_label_job(path: Path, n: int, seed: int = 0) -> None:
    rng, voc = random.Random(seed), vocabulary()
    with open(path, "wb") as f:
        for i in range(n):
            text = "Label the topic of this text: " + words(rng.randint(*LABEL_WORDS), rng, voc)
            f.write(orjson.dumps({"id": f"doc-{i}", "prompt": text}) + b"\n")


def write_bench_job(path: Path, n: int, vocab_size: int, lo_hi: tuple[int, int], seed: int = 0) -> None:
    w = Workload(num_prompts=n, input_len=lo_hi, output_len=lo_hi, prefix_len=0, temperature=0.6, seed=seed, warmup=0)
    write_requests_jsonl(path, make_requests(w, vocab_size, avoid=set()))


def run_cli(model: Path, inp: Path, out: Path, engine: dict, sampling_flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "llmcli", "generate", str(inp), "-o", str(out), "--overwrite", "--model", str(model),
           "--verbose",
           *(f for k, v in engine.items() for f in (f"--{k.replace('_', '-')}", str(v))), *sampling_flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, timeout=900)
    wall = time.perf_counter() - start
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"CLI failed ({proc.returncode}):\n{err[-3000:]}")
    ready = re.search(r"engine ready after ([\d.]+) s", err)
    gen = re.search(r"generation time\s*│\s*([\d.]+) s", err)
    phases = re.search(r"start-up: (.*?); input", err)
    return dict(wall_s=wall, ready_s=float(ready.group(1)) if ready else None,
                generation_s=float(gen.group(1)) if gen else None, phases=phases.group(1) if phases else "",
                lines=out.read_bytes().count(b"\n"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the bundled tiny model, small counts")
    ap.add_argument("--config", default=str(REPO / "configs" / "Qwen3-0.6B"), help="model config folder")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--jobs", default="label,bench", help="label, bench or both")
    args = ap.parse_args()
    engine: dict = {"load_format": "dummy"}
    records, bench_records, bench_len = 20_000, 256, (100, 1024)  # the label job; bench's default
    if args.smoke:
        args.config, args.repeat = str(REPO / "examples" / "tiny-qwen3"), 1
        records, bench_records, bench_len = 16, 4, (16, 64)
        engine.update(device="cpu", max_model_len=2048)
    work = Path(tempfile.mkdtemp(prefix="llmcli-job-"))
    t = time.perf_counter()
    vocab = json.loads((Path(args.config) / "config.json").read_text())["vocab_size"]
    model = write_model_dir(args.config, work / "model", vocab_size=None if not args.smoke else vocab)
    print(f"model folder with a {vocab if args.smoke else 151646}-id tokenizer in {time.perf_counter() - t:.1f} s",
          flush=True)
    jobs = {}
    if "label" in args.jobs:
        write_label_job(work / "label.jsonl", records)
        label_sampling = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        jobs["label"] = (work / "label.jsonl", ["--config", str(REPO / "configs" / "bench-label-20k.toml")],
                         label_sampling)
    if "bench" in args.jobs:
        write_bench_job(work / "bench.jsonl", bench_records, vocab, bench_len)
        jobs["bench"] = (work / "bench.jsonl", ["--temperature", "0.6", "--ignore-eos"],
                         {"temperature": 0.6, "ignore_eos": True})
    print(f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM')}", flush=True)
    rows = []
    for name, (inp, flags, sampling) in jobs.items():
        last = {}
        for round_ in range(1, args.repeat + 1):
            cli = run_cli(model, inp, work / f"{name}.out.jsonl", engine, flags)
            print(f"[{name} {round_}] CLI wall {cli['wall_s']:.1f} s, engine ready after {cli['ready_s']} s, "
                  f"generation {cli['generation_s']} s, start-up phases: {cli['phases']}", flush=True)
            # the child reads the input after its imports, so import_s is the imports alone
            api = run_child(API, dict(model=str(model), input=str(inp), engine=engine, sampling=sampling))
            print(f"[{name} {round_}] API start-up {api['startup_s']:.1f} s ({api['phases']}), tokenize "
                  f"{api['tokenize_s']:.2f} s, generate {api['generate_s']:.1f} s, {api['prompt_tokens']:,} prompt "
                  f"tokens (imports before LLM(): {api['import_s']:.1f} s; engine ready "
                  f"{api['from_launch_s']:.1f} s after the process was launched)", flush=True)
            last = dict(cli=cli, api=api)
        cli, api = last["cli"], last["api"]
        overhead = cli["wall_s"] - api["startup_s"] - api["generate_s"]
        rows.append((name, cli["wall_s"], cli["ready_s"], cli["generation_s"], api["startup_s"],
                     api["from_launch_s"], api["generate_s"], overhead, api["prompt_tokens"]))
    print("\nAPI start-up: LLM() alone; from launch: process launch to a ready engine (imports included)")
    print("job    | CLI wall | CLI ready | CLI gen | API start-up | from launch | API generate | CLI overhead | "
          "prompt tokens")
    for r in rows:
        print(f"{r[0]:<6} | {r[1]:7.1f}s | {r[2] or 0:8.1f}s | {r[3] or 0:6.1f}s | {r[4]:11.1f}s | {r[5]:10.1f}s | "
              f"{r[6]:11.1f}s | {r[7]:+11.1f}s | {r[8]:,}")


if __name__ == "__main__":
    main()
