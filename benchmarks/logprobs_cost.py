"""What logprobs=5 costs: the default bench workload through the Python API, with and without logprobs.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import time

from llmcli import LLM, SamplingParams
from llmcli.cli.bench import Workload, make_requests


def run(llm: LLM, requests: list[tuple[list[int], int]], logprobs: int | None) -> tuple[float, int]:
    llm.engine.step_timer.reset()
    params = [SamplingParams(temperature=0.6, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                             max_tokens=n_out, ignore_eos=True, logprobs=logprobs) for _, n_out in requests]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    PHASES[logprobs is not None].append(llm.engine.step_timer.summary().get("decode", {}))
    if logprobs is not None:
        # The per-token {id: Logprob} dicts are built when first read (engine/logprob_outputs.py): time that
        # apart, and check the values came back, one position per token, k alternatives each.
        start = time.perf_counter()
        positions = [list(o.outputs[0].logprobs) for o in outs]
        BUILD_S.append(time.perf_counter() - start)
        assert all(len(p) == len(o.token_ids) for p, o in zip(positions, outs))
        assert all(len(x) >= logprobs for p in positions for x in p)
    return elapsed, tokens


LOGPROBS, REPEATS = 5, 2  # the k; runs of each setting, alternating
BUILD_S: list[float] = []
PHASES: dict[bool, list[dict]] = {False: [], True: []}  # per run: the step timer's decode row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: configs/Qwen3-0.6B (dummy), or the tiny model with --smoke")
    ap.add_argument("--smoke", action="store_true", help="CPU, the bundled tiny model, 8 short requests")
    args = ap.parse_args()
    if args.smoke:
        model = args.model or "examples/tiny-qwen3"
        llm = LLM(model, device="cpu", max_num_seqs=8, kvcache_block_size=16, num_kvcache_blocks=64,
                  max_model_len=256)
        workload = Workload(num_prompts=8, input_len=(16, 48), output_len=(8, 16))
    else:
        model = args.model or "configs/Qwen3-0.6B"
        llm = LLM(model, load_format="dummy")
        workload = Workload()
    config = llm.engine.config
    requests = make_requests(workload, config.hf_config.vocab_size, set(config.eos_token_ids))
    warm = make_requests(Workload(num_prompts=4, input_len=(16, 16), output_len=(4, 4), seed=1),
                         config.hf_config.vocab_size, set(config.eos_token_ids))
    run(llm, warm, None)
    run(llm, warm, LOGPROBS)
    results: dict[str, list[tuple[float, int]]] = {"off": [], "on": []}
    for _ in range(REPEATS):
        results["off"].append(run(llm, requests, None))
        results["on"].append(run(llm, requests, LOGPROBS))
    best = {key: max(tokens / elapsed for elapsed, tokens in runs) for key, runs in results.items()}
    ratio = best["on"] / best["off"]
    print(f"\nlogprobs cost: {model} on {config.device} ({config.torch_dtype}), {workload.num_prompts} requests, "
          f"{sum(t for _, t in results['off'][:1])} output tokens per run")
    print("| setting | output tok/s (best of %d) | runs (s) |" % REPEATS)
    print("| --- | --- | --- |")
    for key, label in (("off", "no logprobs"), ("on", f"logprobs={LOGPROBS}")):
        print(f"| {label} | {best[key]:,.0f} | {', '.join(f'{e:.2f}' for e, _ in results[key])} |")
    built = min(BUILD_S[1:] or BUILD_S)
    print(f"| reading every logprob back as vLLM-shaped dicts (after the run) | {built:.2f} s | |")
    # host time per decode step (the launches return at once, so the sum is what the loop spends on the host
    # besides waiting for the device); from the last run of each setting
    for key, label in ((False, "no logprobs"), (True, f"logprobs={LOGPROBS}")):
        row = PHASES[key][-1]
        phases = ", ".join(f"{name} {row.get(name + '_ms', 0):.3f}" for name in ("prepare", "forward", "sample",
                                                                                 "wait", "postprocess"))
        print(f"| {label}: ms per decode step ({row.get('steps', 0)} steps) | host {row.get('host_ms', 0):.3f} "
              f"| {phases} |")
    verdict = "PASS" if ratio >= 0.9 else "FAIL"
    print(f"| ratio | {ratio:.3f} ({(1 - ratio) * 100:.1f}% cost; bar: at most 10%) | {verdict} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
