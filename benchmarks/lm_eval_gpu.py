"""What lm-eval through llmcli costs over the engine (issue 42): a local 2,000-question multiple-choice task
(4 choices, ~60-token questions) through ``lm_eval.simple_evaluate(model=<llmcli's lm-eval model>)``, against
``LLM.generate`` on the very prompts and SamplingParams that run sent, on the same engine (no start-up in
either). The bar: the backend's overhead at most 10%.

    python3 benchmarks/lm_eval_gpu.py              # GPU: Qwen3-8B dummy weights, synthetic full-size tokenizer
    python3 benchmarks/lm_eval_gpu.py --smoke      # CPU: the bundled tiny model, 16 questions
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from llmcli import LLM  # noqa: E402
from llmcli.lm_eval import LLMCLIModel  # noqa: E402
from synth_tokenizer import vocabulary, words, write_model_dir  # noqa: E402

TASK = """task: bench_mc
dataset_path: json
dataset_kwargs: {data_files: {test: %s}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}]
"""

args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
args.add_argument("--smoke", action="store_true")
args.add_argument("--questions", type=int, default=2000)
opts = args.parse_args()
work = Path(tempfile.mkdtemp(prefix="lm_eval_bench_"))
if opts.smoke:
    model, engine, n = "examples/tiny-qwen3", {"device": "cpu", "num_kvcache_blocks": 64}, 16
    vocab = ["the", "quick", "fox", "sea", "gate", "dog"]
else:
    model, engine, n = str(write_model_dir("configs/Qwen3-8B", work / "model")), {"load_format": "dummy"}, opts.questions
    vocab = vocabulary()
rng = random.Random(0)
with open(work / "mc.jsonl", "w") as f:
    for _ in range(n):
        f.write(json.dumps({"question": words(40, rng, vocab), "choices": [" " + words(6, rng, vocab) for _ in range(4)],
                            "answer": rng.randrange(4)}) + "\n")
(work / "bench_mc.yaml").write_text(TASK % (work / "mc.jsonl"))

lm = LLMCLIModel(model, **engine)
sent: list[tuple[list, list]] = []
run = lm._run
lm._run = lambda prompts, params: sent.append((prompts, params)) or run(prompts, params)  # what lm-eval sends
llm = LLM.__new__(LLM)  # the very engine lm-eval drives: neither side pays start-up
llm.engine = lm.engine


def evaluate() -> float:
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=TaskManager(
        include_path=str(work), include_defaults=False), log_samples=False)
    assert out["results"]["bench_mc"]["acc,none"] >= 0
    return time.perf_counter() - start


def plain() -> float:
    start = time.perf_counter()
    for prompts, params in sent[-1:]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert len(outs) == len(prompts) and all(o.prompt_logprobs for o in outs)
    return time.perf_counter() - start


evaluate(), plain()  # warm-up: compiles every variant, loads the dataset once
lm_s, plain_s = min(evaluate() for _ in range(2)), min(plain() for _ in range(2))
print("| model | questions | requests | lm-eval through llmcli s | LLM.generate s | overhead |")
print(f"| {Path(model).name} | {n} | {len(sent[-1][0])} | {lm_s:.2f} | {plain_s:.2f} | {lm_s / plain_s - 1:+.1%} |")
print(f"overhead within 10%: {lm_s <= 1.10 * plain_s}")
