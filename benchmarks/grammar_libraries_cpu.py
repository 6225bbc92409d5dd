#!/usr/bin/env python
"""llguidance against xgrammar on this CPU: how llmcli's grammar library was chosen (benchmarks/RESULTS.md).

For the tiny test tokenizer (~600 ids) and a Qwen3-size byte-level BPE one (151,646 ids, built offline by
full_size_tokenizer.py): tokenizer-table build time, compile time of four JSON schemas, the time to fill one
sequence's token bitmask at every step of a valid output, and one step's fill for 256 sequences under one
schema at different positions. Needs both libraries (``pip install llguidance xgrammar``); CPU only.

    python benchmarks/grammar_libraries_cpu.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 150}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 3}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["tags", "score"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"},
                                                  "email": {"type": "string"}}, "required": ["id"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}}},
     "required": ["user", "items"]},
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number"}}, "required": ["label"]},
]
INSTANCES = [{"name": "Ada Lovelace", "age": 36}, {"tags": ["a", "c"], "score": 0.25},
             {"user": {"id": "abc12", "email": "x@y.z"}, "items": [{"sku": "K-1", "qty": 3}, {"sku": "K-22", "qty": 1}]},
             {"label": "neutral", "confidence": 0.9}]
BATCH = 256


class Llg:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf

        self.llg, self.tok = llguidance, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
        self.width = (len(tok) + 31) // 32
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_json_schema(schema))
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask, row):
        m.unsafe_compute_mask_ptr(mask[row].data_ptr(), self.width * 4)

    def fill_batch(self, ms, mask):
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], mask.data_ptr(), self.width * 4,
                                              len(ms))

    def accept(self, m, t):
        assert m.consume_token(t), m.get_error()


class Xgr:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar

        self.xgr = xgrammar
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)),
                                                 cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask, row):
        m.fill_next_token_bitmask(mask, row)

    def fill_batch(self, ms, mask):
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m, t):
        assert m.accept_token(t)


def measure(lib_cls, label, tok) -> str:
    import torch

    start = time.perf_counter()
    lib = lib_cls(tok)
    init = time.perf_counter() - start
    compiled, times = [], []
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiled.append(lib.compile(schema))
        times.append(time.perf_counter() - start)
    mask = torch.full((BATCH, (len(tok) + 31) // 32), -1, dtype=torch.int32)
    fills = []
    for c, inst in zip(compiled, INSTANCES):
        m = lib.matcher(c)
        for t in tok.encode(json.dumps(inst), add_special_tokens=False):
            start = time.perf_counter()
            lib.fill(m, mask, 0)
            fills.append(time.perf_counter() - start)
            lib.accept(m, t)
    fills.sort()
    ids = tok.encode(json.dumps(INSTANCES[2]), add_special_tokens=False)
    batch = []
    for i in range(BATCH):
        m = lib.matcher(compiled[2])
        for t in ids[: i % len(ids)]:
            lib.accept(m, t)
        batch.append(m)
    steps = []
    for _ in range(5):
        start = time.perf_counter()
        lib.fill_batch(batch, mask)
        steps.append(time.perf_counter() - start)
    return (f"| {lib.name} | {label} ({len(tok):,} ids) | {init * 1e3:,.0f} | "
            f"{' / '.join(f'{t * 1e3:.1f}' for t in times)} | {fills[len(fills) // 2] * 1e6:.0f} / "
            f"{fills[int(len(fills) * 0.9)] * 1e6:.0f} / {statistics.mean(fills) * 1e6:.0f} | "
            f"{statistics.median(steps[1:]) * 1e3:.2f} |")


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from full_size_tokenizer import build

    torch.set_num_threads(1)
    tokenizers = [("tiny test tokenizer", AutoTokenizer.from_pretrained(str(REPO / "examples" / "tiny-qwen3"))),
                  ("full-size BPE", build())]
    print("| library | tokenizer | tokenizer tables ms | compile ms (4 schemas) | one-row fill µs p50 / p90 / mean | "
          f"{BATCH}-row fill ms |\n|---|---|---|---|---|---|")
    for cls in (Llg, Xgr):
        for label, tok in tokenizers:
            print(measure(cls, label, tok), flush=True)


if __name__ == "__main__":
    main()
