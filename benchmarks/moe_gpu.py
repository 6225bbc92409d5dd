#!/usr/bin/env python
"""Issue #31's GPU stage: Qwen3-MoE speed against the MoE bound, the fused kernel against the reference loop, and
teacher-forced agreement with transformers, in one run (about 6 minutes on an H200).

1. kernel: one MoE block at Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, experts of 768), bf16,
   for 1 to 8,192 tokens: ``kernels/triton_moe.fused_moe`` against ``kernels/moe_reference.moe_reference``
   (the loop over experts), time of each and the fused output's error against the loop in float32.
2. engine: Qwen3-30B-A3B with ``--load-format dummy`` on the default bench workload (256 requests, prompts and
   outputs of 100-1024 tokens, temperature 0.6): output tok/s and the share of the MoE physical bound
   (``benchmarks/harness/bound.py``: dense weights each step, the experts a step's batch touches under uniform
   routing, KV) measured in the same run. Then 16 short greedy requests three ways on the same engine: the
   fused kernel in CUDA graphs (the default), fused eager, and the reference loop eager
   (``LLMCLI_MOE=reference``; it syncs per layer, so no graphs): tok/s and token agreement with the default.
3. agreement: a random Qwen3-MoE checkpoint (30B-A3B's shapes, 4 layers, layer 1 dense) written here, 16
   prompts x 32 greedy tokens, llmcli's token after each of transformers' own prefixes (teacher-forced):
   >= 95% must agree and every mismatch must be a near-tie in transformers' logits.

Exits 1 when a correctness check fails (kernel error, wrong output lengths, agreement).

    python benchmarks/moe_gpu.py                      # the GPU run
    python benchmarks/moe_gpu.py --smoke   # CPU smoke test on tiny shapes (about a minute; tests/test_benchmark_smoke.py)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "tests"):  # tests/: the checkpoint writers and the greedy comparisons
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

MODEL = REPO / "configs" / "Qwen3-30B-A3B"
SMOKE_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 mlp_only_layers=[1], decoder_sparse_step=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and a tiny model, on the CPU")
    p.add_argument("--sections", default="kernel,engine,agreement")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
    # the short greedy requests of sections 2 and 3 (fewer in the smoke run: the kernel is interpreted there)
    args.probes, args.new_tokens = (4, 8) if args.smoke else (16, 32)
    return args


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up call."""
    from benchmarks.harness.ceilings import time_op

    return statistics.median(time_op(fn, device, reps, warmup=1))


# -- 1. the kernel ----------------------------------------------------------------------------------------

def kernel_section(args: argparse.Namespace, failures: list[str]) -> list[list[Any]]:
    import torch

    from llmcli.kernels.moe_reference import moe_reference, route
    from llmcli.kernels.triton_moe import fused_moe

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    experts, top_k, hidden, inter = (8, 2, 64, 32) if args.smoke else (128, 8, 2048, 768)
    counts = (1, 5, 40) if args.smoke else (1, 16, 64, 256, 2048, 8192)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dev, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dev, dtype)
    w13_f, w2_f = w13.float(), w2.float()
    rows = []
    for tokens in counts:
        x = torch.randn(tokens, hidden, generator=g).to(dev, dtype)
        weights, ids = route(torch.randn(tokens, experts, generator=g).to(dev), top_k, normalize=True)
        fused_s = timed(lambda: fused_moe(x, w13, w2, weights, ids), dev, 3 if args.smoke else 20)
        ref_s = timed(lambda: moe_reference(x, w13, w2, weights, ids), dev, 2 if args.smoke else 5)
        ref32 = moe_reference(x.float(), w13_f, w2_f, weights, ids)
        err = ((fused_moe(x, w13, w2, weights, ids).float() - ref32).norm() / ref32.norm()).item()
        ok = err < tol
        if not ok:
            failures.append(f"kernel: {tokens} tokens, relative error {err:.2e} >= {tol:.0e}")
        rows.append([tokens, f"{1e3 * fused_s:.3f}", f"{1e3 * ref_s:.3f}", f"{ref_s / fused_s:.1f}x", f"{err:.2e}",
                     "ok" if ok else "FAIL"])
    return rows


# -- 2. the engine ----------------------------------------------------------------------------------------

def tiny_moe_config() -> Path:
    """A dummy-weight folder for the smoke run: the bench's tiny config made a mixture of experts."""
    from benchmarks.harness.workload import TINY_CONFIG

    folder = Path(tempfile.mkdtemp(prefix="llmcli-moe-")) / "Qwen3-MoE-tiny"
    folder.mkdir()
    cfg = {**TINY_CONFIG, **SMOKE_MOE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def greedy_probe(llm: Any, prompts: list[list[int]], device: str, new_tokens: int,
                 ) -> tuple[float, list[list[int]]]:
    from llmcli import SamplingParams

    from benchmarks.harness.ceilings import sync

    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    sync(device)
    return len(prompts) * new_tokens / (time.perf_counter() - t), [list(o.token_ids) for o in outs]


def engine_section(args: argparse.Namespace, failures: list[str]) -> tuple[list[list[Any]], list[list[Any]]]:
    from benchmarks.harness.ceilings import free_memory
    from benchmarks.harness.output import say
    from benchmarks.harness.workload import model_facts
    from benchmarks.speed_gpu import ceilings
    from llmcli import LLM

    model = tiny_moe_config() if args.smoke else MODEL
    facts = model_facts(model)
    ceil = ceilings(args.device, args.smoke)
    kwargs: dict[str, Any] = dict(load_format="dummy", device=args.device, seed=0)
    if args.smoke:
        kwargs.update(num_kvcache_blocks=512, max_model_len=512, max_num_batched_tokens=256)
    start = time.perf_counter()
    llm = LLM(str(model), **kwargs)
    say(f"{facts['name']}: ready in {time.perf_counter() - start:.1f} s")
    try:
        return measure_engine(llm, facts, ceil, args, failures)
    finally:
        llm.shutdown()
        del llm
        free_memory(args.device)  # the 30B engine's memory back before the next section builds its own


def measure_engine(llm: Any, facts: dict[str, Any], ceil: dict[str, float], args: argparse.Namespace,
                   failures: list[str]) -> tuple[list[list[Any]], list[list[Any]]]:
    """The bench workload against the bound, then the short greedy requests down the three MoE paths."""
    from benchmarks.harness.bound import physical_bound, print_bound
    from benchmarks.harness.llmcli_run import llmcli_generate
    from benchmarks.harness.workload import check_lengths
    from greedy_compare import agreement
    from llmcli.cli.bench import Workload, make_requests

    avoid = set(facts["eos_token_ids"])
    work = Workload(num_prompts=16, input_len=(10, 60), output_len=(5, 40), seed=0) if args.smoke else Workload()
    reqs = make_requests(work, facts["vocab"], avoid)
    prompts, outs = [r[0] for r in reqs], [r[1] for r in reqs]
    probes = [p for p, _ in make_requests(Workload(num_prompts=args.probes, input_len=(20, 200),
                                                   output_len=(4, 4), seed=7), facts["vocab"], avoid)]
    engine = llm.engine
    llmcli_generate(llm, probes[:4], [4] * 4, work.temperature, args.device)  # warm-up
    wall, got = llmcli_generate(llm, prompts, outs, work.temperature, args.device)
    bad = check_lengths(got, outs)
    if bad:
        failures.append(f"engine: output lengths wrong: {'; '.join(bad[:3])}")
    bound = physical_bound(facts, prompts, outs, ceil, 2 if args.device == "cuda" else 4,
                           max_concurrent=engine.config.max_num_seqs)
    print_bound(facts["name"], bound)
    share = bound["floor_s"] / wall
    speed = [[facts["name"], "default bench workload", f"{sum(got) / wall:,.0f}", f"{wall:.2f}",
              f"{bound['floor_tok_s']:,.0f}", f"{100 * share:.1f}%"]]
    runner = engine.model_runner
    graphs = runner.graphs
    rows = []
    engine.scheduler.block_manager.reset_prefix_cache()
    os.environ["LLMCLI_MOE"] = "triton"  # the fused kernel on the CPU too (interpreted), for the smoke run
    try:
        base_tps, base = greedy_probe(llm, probes, args.device, args.new_tokens)
        rows.append(["fused, CUDA graphs" if graphs is not None else "fused (no graphs on this device)",
                     f"{base_tps:,.0f}", "100.00%"])
        runner.graphs = None  # eager decode steps: the reference loop cannot be captured
        for name, mode in (("fused, eager", "triton"), ("reference loop, eager", "reference")):
            os.environ["LLMCLI_MOE"] = mode
            engine.scheduler.block_manager.reset_prefix_cache()
            tps, tokens = greedy_probe(llm, probes, args.device, args.new_tokens)
            rows.append([name, f"{tps:,.0f}", f"{100 * agreement(tokens, base):.2f}%"])
    finally:
        runner.graphs = graphs
        os.environ.pop("LLMCLI_MOE", None)
    return speed, rows


# -- 3. agreement with transformers ---------------------------------------------------------------------------

def agreement_section(args: argparse.Namespace, failures: list[str]) -> list[list[Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from greedy_compare import agreement, count_near_ties, non_tie_mismatches, regroup, teacher_forced_prompts
    from llmcli import LLM, SamplingParams
    from tiny_qwen3 import write_random_published, write_tiny_model

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    folder = Path(tempfile.mkdtemp(prefix="llmcli-moe-ckpt-"))
    if args.smoke:
        path = write_tiny_model(folder, "qwen3-moe-top8")
    else:
        path = write_random_published(MODEL / "config.json", folder, device=dev, dtype=dtype,
                                      overrides={"num_hidden_layers": 4, "mlp_only_layers": [1]})
        torch.cuda.empty_cache()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, min(vocab, 600) if args.smoke else vocab) for _ in range(rng.randint(8, 300))]
               for _ in range(args.probes)]

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(dev).eval()
    hf_tokens, step_logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            cont = gen[0, len(p):].tolist()
            hf_tokens.append(cont)
            step_logits.append(hf(torch.tensor([p + cont[:-1]], device=dev)).logits[0, len(p) - 1:].float().cpu())
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()

    kwargs: dict[str, Any] = dict(device=dev, dtype=str(dtype).removeprefix("torch."), max_model_len=1024)
    if dev == "cuda":
        kwargs["gpu_memory_utilization"] = 0.5
    llm = LLM(str(path), **kwargs)
    try:
        flat = llm.generate(teacher_forced_prompts(prompts, hf_tokens),
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        forced = regroup([o.token_ids[0] for o in flat], args.new_tokens)
        free = [list(o.token_ids) for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))]
    finally:
        llm.shutdown()
    rate = agreement(forced, hf_tokens)
    bad = non_tie_mismatches(step_logits, forced, hf_tokens, first_only=False)
    if rate < 0.95:
        failures.append(f"agreement: teacher-forced {rate:.2%} < 95%")
    failures.extend(f"agreement: not a near-tie: {m}" for m in bad)
    ties = count_near_ties(step_logits)
    return [["teacher-forced vs transformers", f"{rate:.2%}", len(bad), f"{ties}/{args.probes * args.new_tokens}"],
            ["free-running vs transformers", f"{agreement(free, hf_tokens):.2%}", "-", "-"]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
    from benchmarks.harness.output import md_table, say

    sections = set(args.sections.split(","))
    failures: list[str] = []
    tables = []
    if "kernel" in sections:
        rows = kernel_section(args, failures)
        tables.append(("fused MoE kernel vs the reference loop (one block)",
                       md_table(["tokens", "fused ms", "loop ms", "speed-up", "rel err vs fp32 loop", "check"], rows)))
    if "engine" in sections:
        speed, rows = engine_section(args, failures)
        tables.append(("output speed against the MoE bound",
                       md_table(["model", "workload", "output tok/s", "s", "bound tok/s", "share of bound"], speed)))
        tables.append((f"{args.probes} greedy requests x {args.new_tokens} tokens, one engine",
                       md_table(["MoE path", "output tok/s", "token agreement with the default"], rows)))
    if "agreement" in sections:
        rows = agreement_section(args, failures)
        tables.append(("random Qwen3-MoE checkpoint vs transformers",
                       md_table(["comparison", "agreement", "mismatches not near-ties", "near-ties in HF"], rows)))
    for title, table in tables:
        say(f"\n### {title}\n\n{table}")
    say("\n" + ("FAILED:\n  " + "\n  ".join(failures) if failures else "all checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
