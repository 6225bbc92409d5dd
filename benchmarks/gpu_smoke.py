"""Seconds-long GPU smoke check: start-up (probe, graphs) and a small greedy batch on dummy Qwen3-0.6B."""
from __future__ import annotations

import sys
import time

from llmcli import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "configs/Qwen3-0.6B"
start = time.perf_counter()
llm = LLM(model, load_format="dummy")
print(f"start-up {time.perf_counter() - start:.1f} s; memory: {llm.engine.model_runner.memory_report}")
prompts = [[(7 * i + j) % 1000 for j in range(50 + 37 * i)] for i in range(8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
assert all(len(o.token_ids) == 32 for o in outs)
print("deterministic greedy + prefix hits:", [a.token_ids == b.token_ids for a, b in zip(outs, again)])
print("stats:", llm.engine.stats)
print("timer:", llm.engine.step_timer.summary())
