"""What lm-eval through llmcli costs over the engine (issue 42): a 2,000-question multiple-choice task (4 choices,
~60-token questions) through ``lm_eval.simple_evaluate`` with llmcli's model vs ``LLM.generate`` on the prompts and
SamplingParams it sent, same engine, no start-up in either. The time inside the model's ``loglikelihood`` splits
lm-eval's wall into lm-eval's own work and the backend's; the bar: the backend at most 10% over LLM.generate.

    python3 benchmarks/lm_eval_gpu.py              # GPU: Qwen3-8B dummy weights, synthetic full-size tokenizer
    python3 benchmarks/lm_eval_gpu.py --smoke      # CPU: the bundled tiny model, 16 questions (or --questions)
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

TASK = {"task": "bench_mc", "dataset_path": "json", "test_split": "test", "output_type": "multiple_choice",
        "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}]}  # written as JSON, which lm-eval's YAML loader reads

args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
args.add_argument("--smoke", action="store_true")
args.add_argument("--questions", type=int, help="default: 2000 (--smoke: 16)")
opts = args.parse_args()
work = Path(tempfile.mkdtemp(prefix="lm_eval_bench_"))
if opts.smoke:
    model, engine, n = "examples/tiny-qwen3", {"device": "cpu", "num_kvcache_blocks": 64}, opts.questions or 16
    vocab = ["the", "quick", "fox", "sea", "gate", "dog"]
else:
    model, engine, n = str(write_model_dir("configs/Qwen3-8B", work / "model")), {"load_format": "dummy"}, opts.questions or 2000
    vocab = vocabulary()
rng = random.Random(0)
with open(work / "mc.jsonl", "w") as f:
    for _ in range(n):
        f.write(json.dumps({"question": words(40, rng, vocab), "choices": [" " + words(6, rng, vocab) for _ in range(4)],
                            "answer": rng.randrange(4)}) + "\n")
(work / "bench_mc.yaml").write_text(json.dumps({**TASK, "dataset_kwargs": {"data_files": {"test": f.name}}}))


def spy(method, calls: list):  # the model's method, each call's arguments and seconds logged
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        calls.append((args, time.perf_counter() - start))
        return out
    return call


lm = LLMCLIModel(model, **engine)
lm._run, lm.loglikelihood = spy(lm._run, sent := []), spy(lm.loglikelihood, inside := [])  # what lm-eval sends
llm = LLM.__new__(LLM)  # the very engine lm-eval drives: neither side pays start-up
llm.engine = lm.engine


def evaluate() -> tuple[float, float]:  # seconds in all, and inside the model's loglikelihood (one call)
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=TaskManager(
        include_path=str(work), include_defaults=False), log_samples=False)
    assert out["results"]["bench_mc"]["acc,none"] >= 0
    return time.perf_counter() - start, inside[-1][1]


def plain() -> float:
    (prompts, params), start = sent[-1][0], time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts) and all(o.prompt_logprobs for o in outs)
    return time.perf_counter() - start


evaluate(), plain()  # warm-up: compiles every variant, loads the dataset once
(lm_s, in_s), plain_s = min(evaluate() for _ in range(2)), min(plain() for _ in range(2))
print("| model | questions | requests | lm-eval s | in the model s | LLM.generate s | overhead | lm-eval's own s |")
print(f"| {Path(model).name} | {n} | {len(sent[-1][0][0])} | {lm_s:.2f} | {in_s:.2f} | {plain_s:.2f} | "
      f"{in_s / plain_s - 1:+.1%} | {lm_s - in_s:.2f} |")
print(f"the model's overhead within 10%: {in_s <= 1.10 * plain_s} (lm-eval's whole wall: {lm_s / plain_s - 1:+.1%})")
