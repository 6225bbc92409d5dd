"""transformers' own continuous batching on the same workload: random weights, EOS disabled, a deadline."""
from __future__ import annotations

import argparse
import contextlib
import random
import time
from typing import Any

import torch

from benchmarks.harness.ceilings import DTYPES, free_memory, sync
from benchmarks.harness.output import log, say
from benchmarks.harness.report import Report, fail
from benchmarks.harness.workload import check_lengths


def hf_collect(manager: Any, expected: dict[str, int], deadline: float, label: str,
               every: float = 15.0) -> tuple[dict[str, Any], str | None]:
    """Finished results by request id; stops at the deadline or if the generation thread dies."""
    got: dict[str, Any] = {}
    last = time.perf_counter()
    t0 = last
    while len(got) < len(expected):
        now = time.perf_counter()
        if now > deadline:
            return got, f"deadline reached with {len(got)}/{len(expected)} requests finished"
        if now - last >= every:
            done_tokens = sum(len(r.generated_tokens) for r in got.values())
            log(f"{label}: {len(got)}/{len(expected)} requests finished ({done_tokens:,} tokens) "
                f"after {now - t0:.0f} s")
            last = now
        res = manager.get_result(timeout=1.0)
        if res is None:
            if not manager.is_running():
                return got, f"the generation thread stopped with {len(got)}/{len(expected)} requests finished"
            continue
        if res.is_finished() and res.request_id in expected:
            got[res.request_id] = res
    return got, None


def run_hf(args: argparse.Namespace, report: Report, facts: dict[str, Any], prompts: list[list[int]],
           outs: list[int], deadline: float) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    name = facts["name"]
    entry: dict[str, Any] = {"transformers": transformers.__version__}
    report.data["transformers"][name] = entry
    dtype = DTYPES[args.dtype]
    cfg = AutoConfig.from_pretrained(facts["path"])
    # the CPU has no memory probe in some versions: the tiny run sizes the cache by hand
    cb_kwargs = {"block_size": 16, "num_blocks": 128, "max_batch_tokens": 256} if args.tiny else {}
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    gen = GenerationConfig(max_new_tokens=max(outs), eos_token_id=-1, **sampling)
    hints: dict[str, Any] = {}
    with contextlib.suppress(ImportError):  # the GPU image's own transformers may predate workload hints
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                                                max_generated_length=max(outs), num_requests=len(prompts))
    model = manager = None
    for impl in dict.fromkeys([args.hf_attn, "sdpa"]):  # sdpa: where this transformers rejects the name asked for
        try:
            t = time.perf_counter()
            torch.manual_seed(args.seed)
            with torch.device(args.device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=impl)
            model = model.to(args.device).eval()
            entry["init_s"] = time.perf_counter() - t
            manager = model.init_continuous_batching(generation_config=gen, **hints,
                                                     continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs))
            entry["attn_requested"] = impl
            break
        except Exception as exc:
            log(f"transformers with attn_implementation={impl!r} failed: {type(exc).__name__}: {exc}")
            entry.setdefault("attn_failures", []).append(f"{impl}: {type(exc).__name__}: {exc}")
            model = manager = None
            free_memory(args.device)
    if manager is None:
        raise RuntimeError(f"no attention implementation worked: {entry.get('attn_failures')}")
    entry["attn_used"] = model.config._attn_implementation
    if entry["attn_requested"] != args.hf_attn:
        say(f"NOTE: transformers rejected attn_implementation={args.hf_attn!r}; running with sdpa instead")
    entry["params"] = sum(p.numel() for p in model.parameters())
    log(f"transformers {name}: model ready in {entry['init_s']:.1f} s, attention {entry['attn_used']}, "
        f"{entry['params']:,} parameters")

    incomplete = None
    try:
        with torch.no_grad():
            t = time.perf_counter()
            getattr(manager, "warmup", lambda: None)()  # likewise
            entry["cb_warmup_s"] = time.perf_counter() - t
            manager.start()
            wrng = random.Random(args.seed + 1)
            warm = {manager.add_request([wrng.randrange(facts["vocab"]) for _ in range(16)], request_id=f"warm-{i}",
                                        max_new_tokens=4, eos_token_id=-1): 4 for i in range(4)}
            t = time.perf_counter()
            _, why = hf_collect(manager, warm, min(deadline, time.perf_counter() + 600), "transformers warm-up")
            entry["warmup_s"] = time.perf_counter() - t
            if why:
                raise RuntimeError(f"warm-up failed: {why}")

            expected: dict[str, int] = {}
            log(f"transformers {name}: timing {len(prompts)} requests, {sum(outs):,} output tokens "
                f"(deadline in {deadline - time.perf_counter():.0f} s)")
            sync(args.device)
            t = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, outs)):
                rid = manager.add_request(p, request_id=f"req-{i}", max_new_tokens=o, eos_token_id=-1)
                expected[rid] = o
            got, incomplete = hf_collect(manager, expected, deadline, f"transformers {name}")
            sync(args.device)
            wall = time.perf_counter() - t
    finally:
        with contextlib.suppress(Exception):
            manager.stop(block=True, timeout=60, hard_stop=incomplete is not None)
        with contextlib.suppress(Exception):
            manager.destroy()
        del manager, model
        free_memory(args.device)

    ids = list(expected)
    lengths = [len(got[r].generated_tokens) if r in got else -1 for r in ids]
    errors = [f"{r}: {got[r].error}" for r in ids if r in got and getattr(got[r], "error", None)]
    tokens = sum(n for n in lengths if n > 0)
    entry.update(requests=len(prompts), finished=len(got), output_tokens=tokens, expected_output_tokens=sum(outs),
                 wall_s=wall, output_tok_s=tokens / wall, complete=incomplete is None, incomplete_reason=incomplete,
                 prompt_tokens=sum(len(p) for p in prompts))
    if incomplete is not None:
        fail(report, f"transformers {name}", f"{incomplete}; the tok/s printed is a lower bound "
                                              "(tokens of finished requests only)")
    bad = check_lengths([n for n in lengths if n >= 0], [outs[i] for i, n in enumerate(lengths) if n >= 0])
    entry["lengths_ok"] = not bad and not errors and incomplete is None
    if bad or errors:
        fail(report, f"transformers {name} output lengths", f"{len(bad)} wrong, {len(errors)} errors: "
                                                             f"{'; '.join((bad + errors)[:5])}")
    say(f"transformers {name} ({entry['attn_used']}): {tokens:,} output tokens in {wall:.2f} s = "
        f"{tokens / wall:,.0f} tok/s{'' if incomplete is None else ' (INCOMPLETE: lower bound)'}")
