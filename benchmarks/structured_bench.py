#!/usr/bin/env python
"""What structured outputs cost: the bench workload unconstrained, under one JSON schema, and under 64 schemas.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from benchmarks.harness.output import out_path, write_json  # noqa: E402
from benchmarks.harness.script_args import add_device_args, settle_device  # noqa: E402
from llmcli import SamplingParams, StructuredOutputsParams  # noqa: E402
from llmcli.cli.bench import Workload, make_requests  # noqa: E402
from llmcli.config import Config  # noqa: E402
from llmcli.engine.llm_engine import LLMEngine  # noqa: E402

def schema(i: int) -> dict:
    """The i-th distinct schema: the same shape, its own field names and bounds. Never finishes early."""
    item = {"type": "object", "additionalProperties": False,
            "properties": {f"name_{i}": {"type": "string", "maxLength": 12},
                           f"qty_{i}": {"type": "integer", "minimum": 0, "maximum": 1000 + i},
                           "tags": {"type": "array", "items": {"enum": ["new", "used", f"kind{i}"]}, "maxItems": 3},
                           "price": {"type": "number", "minimum": 0}},
            "required": [f"name_{i}", f"qty_{i}", "tags"]}
    return {"type": "object", "properties": {"records": {"type": "array", "items": item, "minItems": 1000}},
            "required": ["records"], "additionalProperties": False}


def run(engine: LLMEngine, requests: list, temperature: float, schemas: list[dict] | None) -> dict:
    engine.step_timer.reset()
    if engine.structured is not None:
        engine.structured.masks.fill_seconds.clear()
    start = time.perf_counter()
    for i, (ids, n_out) in enumerate(requests):
        constraint = None if schemas is None else StructuredOutputsParams(json=schemas[i % len(schemas)])
        engine.add_request(ids, SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, min_p=0.0,
                                               max_tokens=n_out, ignore_eos=True, seed=i,
                                               structured_outputs=constraint), request_id=i)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.token_ids) for o in outs)
    want = sum(n for _, n in requests)
    decode = engine.step_timer.summary().get("decode", {})
    fills = sorted(engine.structured.masks.fill_seconds) if engine.structured is not None else []
    pct = {f"fill_p{q}_ms": 1e3 * fills[min(len(fills) - 1, len(fills) * q // 100)] if fills else 0.0
           for q in (50, 90, 99, 100)}
    return {"requests": len(outs), "output_tokens": n_out, "expected_tokens": want, "elapsed_s": elapsed,
            "output_tok_s": n_out / elapsed, "finish": sorted({o.finish_reason for o in outs}),
            "aborted": sum(o.finish_reason == "abort" for o in outs),
            "decode_steps": decode.get("steps", 0), "wait_ms": decode.get("wait_ms", 0.0),
            "mask_ms": decode.get("mask_ms", 0.0), "host_ms": decode.get("host_ms", 0.0)} | pct


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "configs" / "Qwen3-0.6B"))
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: build the full-size one)")
    add_device_args(p, smoke="tiny model, few short requests (CPU)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--schemas", type=int, default=64)
    args = p.parse_args()
    settle_device(p, args)
    w = Workload(num_prompts=args.num_prompts)
    knobs: dict = {"device": args.device}
    if args.smoke:
        args.model, args.tokenizer = str(REPO / "examples" / "tiny-qwen3"), args.tokenizer or None
        w = Workload(num_prompts=min(args.num_prompts, 8), input_len=(8, 32), output_len=(16, 48))
        args.schemas = min(args.schemas, 4)
        knobs.update(enforce_eager=True, max_model_len=256)
    else:
        knobs["load_format"] = "dummy"
        if args.tokenizer is None:
            from synth_tokenizer import write_model_dir

            start = time.perf_counter()
            args.tokenizer = str(write_model_dir(args.model, Path(tempfile.mkdtemp()) / "tokenizer"))
            print(f"built the full-size tokenizer in {time.perf_counter() - start:.1f} s", flush=True)
    if args.tokenizer:
        knobs["tokenizer"] = args.tokenizer
    config = Config(args.model, **knobs)
    engine = LLMEngine(config)
    requests = make_requests(w, config.hf_config.vocab_size, set(config.eos_token_ids))
    result: dict = {"model": args.model, "device": config.device, "workload": vars(w) | {"schemas": args.schemas}}
    try:
        # warm-up: tokenizer tables, the mask kernel's compilation, one schema (not one of the timed ones)
        start = time.perf_counter()
        warm = make_requests(Workload(num_prompts=4, input_len=(16, 16), output_len=(8, 8), seed=1),
                             config.hf_config.vocab_size, set(config.eos_token_ids))
        run(engine, warm, 1.0, [schema(10_000)])
        result["warmup_s"] = time.perf_counter() - start
        result["unconstrained"] = run(engine, requests, w.temperature, None)
        print("unconstrained", json.dumps(result["unconstrained"]), flush=True)
        compiled = set(engine.structured.compiler.compile_seconds)
        result["one_schema"] = run(engine, requests, w.temperature, [schema(0)])
        print("one schema", json.dumps(result["one_schema"]), flush=True)
        result["one_schema_templates"] = engine.structured.compiler.templates(StructuredOutputsParams(json=schema(0)))
        result["many_schemas"] = run(engine, requests, w.temperature, [schema(i + 1) for i in range(args.schemas)])
        print(f"{args.schemas} schemas", json.dumps(result["many_schemas"]), flush=True)
        seconds = [s for k, s in engine.structured.compiler.compile_seconds.items() if k not in compiled]
        result["compile_ms"] = {"count": len(seconds), "mean": 1e3 * sum(seconds) / len(seconds),
                                "max": 1e3 * max(seconds)}
    finally:
        engine.shutdown()
        write_json(out_path("structured.json"), result)
    base = result["unconstrained"]["output_tok_s"]
    ok = all(result[k]["output_tokens"] == result[k]["expected_tokens"]
             for k in ("unconstrained", "one_schema", "many_schemas"))
    print(f"\n| run | output tok/s | vs unconstrained | decode ms/step: wait | mask | host | "
          f"mask fill ms p50 / p90 / p99 / max | aborted |\n|---|---|---|---|---|---|---|---|")
    for key, label in (("unconstrained", "unconstrained"), ("one_schema", "one JSON schema"),
                       ("many_schemas", f"{args.schemas} distinct schemas")):
        r = result[key]
        print(f"| {label} | {r['output_tok_s']:,.0f} | {r['output_tok_s'] / base:.3f} | {r['wait_ms']:.2f} | "
              f"{r['mask_ms']:.2f} | {r['host_ms']:.2f} | {r['fill_p50_ms']:.2f} / {r['fill_p90_ms']:.2f} / "
              f"{r['fill_p99_ms']:.2f} / {r['fill_p100_ms']:.2f} | {r['aborted']} |")
    c = result["compile_ms"]
    print(f"\nschema compile: {c['count']} schemas, mean {c['mean']:.1f} ms, max {c['max']:.1f} ms "
          f"(warm-up incl. tokenizer tables and the first compile: {result['warmup_s']:.1f} s); "
          f"every request produced its full length: {ok}; mask threads: {engine.structured.masks.threads}; "
          f"compiled templates of the one schema: {result['one_schema_templates']} (copies of one template "
          f"share a lexer lock)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
