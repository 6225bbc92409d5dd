#!/usr/bin/env python
"""Issue #30's GPU stage: FP8 weights and the FP8 KV cache against bf16, in one run (about 9 minutes on an H200).

1. Ceilings: copy bandwidth, the bf16 and the FP8 (``torch._scaled_mm``, row-wise scales) matmul rates.
2. GEMM exactness: ``Fp8Linear`` against the bf16 matmul of its own dequantized operands (FAIL over 1%).
3. Speed, bf16 engine against its FP8 twin in the same run, dummy weights, against the physical bound with the
   FP8 byte counts: Qwen3-8B default workload with ``quantization=fp8`` (bar 1.25x), the prefill-heavy preset's
   shape on Qwen3-8B (``--heavy-prompts`` of its 20,000 prompts, bar 1.5x), Qwen3-0.6B default workload with
   ``kv_cache_dtype=fp8`` (bar 1.3x).
4. Agreement: a small Qwen3 trained here for ``--train-s`` seconds on the repository's own text (random weights
   are no signal), teacher-forced: the bf16 engine's greedy continuations fed back as prompts, and at every
   position the argmax of FP8 weights / FP8 KV compared with bf16's (bar 97%), beside the control, bf16 on the
   torch backend against bf16 on the triton backend.

Exit status 1 when a check fails (a bar missed, an inexact GEMM, wrong token counts); the tables print anyway.

    python benchmarks/fp8_gpu.py                      # the GPU run
    python benchmarks/fp8_gpu.py --device cpu --tiny  # CPU smoke test (a minute): tiny models, bars not applied
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks.harness.bound import physical_bound  # noqa: E402
from benchmarks.harness.ceilings import time_op  # noqa: E402
from benchmarks.harness.output import md_table, say  # noqa: E402
from benchmarks.harness.workload import model_facts, write_tiny_config  # noqa: E402
from benchmarks.speed_gpu import NEUTRAL, agreement, ceilings, preset_workload, step_records, timed_run  # noqa: E402
from llmcli.cli.bench import Workload, make_requests  # noqa: E402

PREFILL_HEAVY = REPO / "configs" / "bench-prefill-heavy.toml"
FAILED: list[str] = []


def fail(what: str) -> None:
    FAILED.append(what)
    say(f"FAILED {what}")


def fp8_matmul_rate(device: str, n: int) -> float:
    from llmcli.layers.quantization.fp8 import quantize_per_channel, quantize_per_token

    a, sa = quantize_per_token(torch.randn(n, n, device=device, dtype=torch.bfloat16))
    b, sb = quantize_per_channel(torch.randn(n, n, device=device))
    sb = sb.view(1, -1)
    s = statistics.median(time_op(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                           out_dtype=torch.bfloat16), device, 10, warmup=3))
    return 2 * n**3 / s


def check_gemm(device: str) -> None:
    from llmcli.layers.quantization.fp8 import Fp8Linear, quantize_per_token

    for m, n, k in ((7, 4096, 4096), (256, 12288, 4096), (4096, 4096, 12288)):
        w = torch.randn(n, k, device=device) * 0.02
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        layer = Fp8Linear(w)
        got = layer.apply(x, None).float()
        xq, xs = quantize_per_token(x)
        want = ((xq.float() * xs).bfloat16() @ (layer.weight.float() * layer.scale.view(-1, 1)).bfloat16().t()).float()
        err = ((got - want).norm() / want.norm()).item()
        say(f"FP8 GEMM {m}x{n}x{k} vs the bf16 matmul of the dequantized operands: rel err {err:.2e}")
        if err > 1e-2:
            fail(f"FP8 GEMM {m}x{n}x{k}: relative error {err:.2e} > 1e-2")


def run_variant(model: Path, kwargs: dict[str, Any], workloads: list[tuple[str, Workload]],
                device: str) -> dict[str, dict[str, Any]]:
    """One engine, every workload in turn (a warm-up first; no run reuses an earlier one's prefix cache)."""
    from llmcli import LLM, SamplingParams

    facts = model_facts(model)
    llm = LLM(str(model), load_format="dummy", device=device, seed=0, **kwargs)
    results = {}
    try:
        records = step_records(llm.engine)
        for name, workload in workloads:
            reqs = make_requests(workload, facts["vocab"], set(facts["eos_token_ids"]))
            prompts, outs = [r[0] for r in reqs], [r[1] for r in reqs]
            llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **NEUTRAL))
            llm.engine.scheduler.block_manager.reset_prefix_cache()
            r = timed_run(llm, prompts, outs, workload.temperature, device, records)
            if r["output_tokens"] != r["expected_tokens"]:
                fail(f"{model.name} {name} {kwargs}: {r['output_tokens']} output tokens, expected {r['expected_tokens']}")
            r.update(facts=facts, prompts=prompts, outs=outs, blocks=llm.engine.model_runner.num_blocks,
                     max_num_seqs=llm.engine.config.max_num_seqs)
            results[name] = r
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def speed(args: argparse.Namespace, ceil: dict[str, float], rows: list) -> None:
    small, big = (write_tiny_config(),) * 2 if args.tiny else (REPO / "configs/Qwen3-0.6B", REPO / "configs/Qwen3-8B")
    heavy = preset_workload(PREFILL_HEAVY)
    heavy.num_prompts = args.heavy_prompts
    default = Workload()
    if args.tiny:
        default = Workload(num_prompts=12, input_len=(16, 64), output_len=(8, 24), temperature=0.6)
        heavy = Workload(num_prompts=48, input_len=(40, 60), output_len=(4, 4), temperature=0.0)
    extra = dict(kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=96) if args.tiny else {}
    # (model, the FP8 engine's settings, [(workload name, workload, bar on FP8 / bf16 throughput)])
    cases = [(big, {"quantization": "fp8"}, [("default", default, 1.25), ("prefill-heavy", heavy, 1.5)]),
             (small, {"kv_cache_dtype": "fp8"}, [("default", default, 1.3)])]
    deadline = time.perf_counter() + args.time_budget
    for model, fp8, jobs in cases:
        if time.perf_counter() > deadline:
            fail(f"{model.name} {fp8}: skipped, past the time budget")
            continue
        workloads = [(name, w) for name, w, _ in jobs]
        base = run_variant(model, extra, workloads, args.device)
        other = run_variant(model, {**extra, **fp8}, workloads, args.device)
        for name, _, bar in jobs:
            ratio = other[name]["output_tok_s"] / base[name]["output_tok_s"]
            for label, r, kw in (("bf16", base[name], {}), (", ".join(f"{k}={v}" for k, v in fp8.items()),
                                                              other[name], fp8)):
                b = physical_bound(r["facts"], r["prompts"], r["outs"], ceil, 2 if args.device == "cuda" else 4,
                                   max_concurrent=r["max_num_seqs"],
                                   weight_elem_bytes=1 if kw.get("quantization") else None,
                                   kv_elem_bytes=1 if kw.get("kv_cache_dtype") else None)
                share = b["floor_s"] / r["wall_s"] if b.get("floor_s") else None
                rows.append([model.name, name, label, f"{r['output_tok_s']:,.0f}", f"{r['wall_s']:.2f}",
                             r["blocks"], "n/a" if share is None else f"{100 * share:.1f}%",
                             f"{ratio:.2f}x (bar {bar}x)" if kw else ""])
            say(f"{model.name} {name}: {fp8} {ratio:.2f}x bf16's throughput (bar {bar}x)")
            if not args.tiny and ratio < bar:
                fail(f"{model.name} {name} {fp8}: {ratio:.2f}x < {bar}x")


def train_small_model(args: argparse.Namespace) -> Path:
    """A small Qwen3 trained on the repository's .py and .md text with the tests' BPE tokenizer."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from tiny_qwen3 import build_tokenizer

    tok = build_tokenizer()
    text = "\n".join(p.read_text(errors="ignore") for ext in ("py", "md") for p in sorted(REPO.rglob(f"*.{ext}"))
                     if ".git" not in p.parts)
    ids = torch.tensor(tok(text[: 400_000 if args.tiny else 8_000_000])["input_ids"])
    dims = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16) if args.tiny else
            dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64))
    config = Qwen3Config(vocab_size=640, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None, **dims)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(args.device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq, batch = (64, 8) if args.tiny else (256, 32)
    windows = ids[: len(ids) // seq * seq].view(-1, seq)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.train_s:
        x = windows[torch.randint(0, len(windows), (batch,))].to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        steps += 1
    say(f"trained {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters for {steps} steps "
        f"({time.perf_counter() - start:.0f} s): loss {loss.item():.3f}")
    out = Path(args.out) / "trained-qwen3"
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=config.eos_token_id, do_sample=False).save_pretrained(out)
    del model, optim
    return out


def argmax_per_position(model: Path, prompts: list[list[int]], device: str, **kwargs: Any) -> list[list[int]]:
    """Teacher-forced: each position's argmax next token over ``prompts`` (prompt_logprobs, top 1)."""
    from llmcli import LLM, SamplingParams

    with LLM(str(model), device=device, dtype="bfloat16" if device == "cuda" else "float32", **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    return [[max(pos.items(), key=lambda kv: kv[1].logprob)[0] for pos in o.prompt_logprobs[1:]] for o in outs]


def agreements(args: argparse.Namespace, rows: list) -> None:
    from llmcli import LLM, SamplingParams

    model = train_small_model(args)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 600, (int(n),), generator=g).tolist() for n in torch.randint(16, 200, (64,), generator=g)]
    backend = "triton" if args.device == "cuda" else "torch"
    with LLM(str(model), device=args.device, attention_backend=backend) as llm:
        cont = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    forced = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, cont)]
    ref = argmax_per_position(model, forced, args.device, attention_backend=backend)
    checks = [("bf16, torch backend (control)", {"attention_backend": "torch"}, None),
              ("quantization=fp8", {"attention_backend": backend, "quantization": "fp8"}, 0.97),
              ("kv_cache_dtype=fp8", {"attention_backend": backend, "kv_cache_dtype": "fp8",
                                      "max_num_batched_tokens": 64}, 0.97)]
    for label, kw, bar in checks:
        got = argmax_per_position(model, forced, args.device, **kw)
        a = agreement(ref, got)
        rows.append([label, f"{100 * a:.2f}%", "" if bar is None else f"{100 * bar:.0f}%"])
        say(f"teacher-forced argmax agreement with bf16 ({backend}): {label}: {100 * a:.2f}%")
        if bar is not None and not args.tiny and a < bar:
            fail(f"agreement {label}: {100 * a:.2f}% < {100 * bar:.0f}%")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny models and workloads, bars not applied (CPU smoke)")
    p.add_argument("--heavy-prompts", type=int, default=2000, help="prompts of the prefill-heavy preset's shape")
    p.add_argument("--train-s", type=float, default=100.0, help="seconds of training for the agreement model")
    p.add_argument("--time-budget", type=float, default=330, help="seconds for the speed runs; later ones skipped")
    p.add_argument("--out", default="/tmp/llmcli-fp8")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        args.train_s = min(args.train_s, 5.0)
    ceil = ceilings(args.device, args.tiny)
    ceil["fp8_matmul_flops_per_s"] = fp8_matmul_rate(args.device, 256 if args.tiny else 8192)
    say(f"FP8 matmul (row-wise scaled): {ceil['fp8_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    check_gemm(args.device)
    speed_rows: list[list[Any]] = []
    agree_rows: list[list[Any]] = []
    speed(args, ceil, speed_rows)
    agreements(args, agree_rows)
    say("\n## FP8 (issue #30)\n")
    say(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.3f} TB/s, bf16 matmul "
        f"{ceil['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, FP8 matmul {ceil['fp8_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s\n")
    say(md_table(["model", "workload", "engine", "output tok/s", "wall s", "KV blocks", "of bound", "vs bf16"],
                 speed_rows, right={3, 4, 5, 6}))
    say("")
    say(md_table(["engine", "teacher-forced argmax agreement with bf16", "bar"], agree_rows, right={1, 2}))
    if FAILED:
        say("\nFAILED:\n" + "\n".join(f"- {f}" for f in FAILED))
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
