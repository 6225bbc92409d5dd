#!/usr/bin/env python
"""Which Triton kernel specializations a run needs that start-up and earlier runs did not (CPU, interpreter).

On the GPU each new specialization of a kernel (Triton compiles one per constexpr value, per integer
argument that is 1 or a multiple of 16, per pointer that is 16-byte aligned or not) is compiled the first
time a step needs it, which stalls that step for about a second. Under ``TRITON_INTERPRET=1`` nothing is
compiled, but this script computes the same key for every launch, so it shows which run would have compiled
what: start-up's variant pass (``warmup.compile_variants``), then a workload with prefill-first steps, then the same
workload with ``mixed_steps``, on the tiny model with the Triton attention backend.

    python benchmarks/triton_variants_cpu.py
"""
from __future__ import annotations

import inspect
import os
import random
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

SEEN: set[tuple] = set()
NEW: list[tuple] = []


def specialization(fn, options: dict, args: tuple, kwargs: dict) -> tuple:
    """The parts of Triton's cache key that change from launch to launch (approximated on the host)."""
    sig = inspect.signature(fn)
    skip = set(options.get("do_not_specialize") or [])
    key: list = [fn.__name__]
    for name, value in list(zip(sig.parameters, args)) + list(kwargs.items()):
        if name in skip:
            continue
        annotation = sig.parameters[name].annotation if name in sig.parameters else None
        if annotation is tl.constexpr or "constexpr" in str(annotation):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), "aligned" if value.data_ptr() % 16 == 0 else "MISALIGNED"))
        elif isinstance(value, bool):
            key.append((name, value))
        elif isinstance(value, int):
            key.append((name, value == 1, value % 16 == 0, abs(value) >= 2**31))
    return tuple(key)


def record(run):
    def wrapped(self, *args, grid, warmup, **kwargs):
        key = specialization(self.fn, self.kwargs, args, kwargs)
        if key not in SEEN:
            SEEN.add(key)
            NEW.append(key)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    return wrapped


def main() -> int:
    interpreter.InterpretedFunction.run = record(interpreter.InterpretedFunction.run)
    from llmcli import LLM, SamplingParams
    from llmcli.engine.warmup import compile_variants

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(20, 120))] for _ in range(24)]
    outs = [rng.randint(8, 30) for _ in prompts]
    llm = LLM(str(REPO / "examples" / "tiny-qwen3"), device="cpu", dtype="float32", attention_backend="triton",
              kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=160)
    compile_variants(llm.engine.model_runner)  # what start-up runs on CUDA
    print(f"start-up variant pass: {len(NEW)} specializations")
    NEW.clear()
    for mixed in (False, True):
        engine = llm.engine
        engine.scheduler.mixed_steps = mixed
        engine.scheduler.block_manager.reset_prefix_cache()
        before = dict(engine.step_timer.steps)
        llm.generate(prompts, [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=1) for o in outs])
        steps = {k: v - before.get(k, 0) for k, v in engine.step_timer.steps.items()}
        print(f"mixed_steps={mixed}: {len(NEW)} specializations first needed in this run; steps {steps}")
        for key in NEW:
            print("   ", key[0], [part for part in key[1:] if "MISALIGNED" in part or len(part) == 2])
        NEW.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
