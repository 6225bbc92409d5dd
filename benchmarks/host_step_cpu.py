#!/usr/bin/env python
"""Host time per decode step at batch 256, on a CPU: the engine's own loop around a stub forward.

What it measures, its options and how to run it: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness.output import md_table  # noqa: E402
from llmcli.config import Config  # noqa: E402
from llmcli.engine.llm_engine import LLMEngine  # noqa: E402
from llmcli.engine.model_runner import ModelRunner  # noqa: E402
from llmcli.engine.step_inputs import StepInputs  # noqa: E402
from llmcli.engine.step_timer import HOST_PHASES  # noqa: E402
from llmcli.sampling_params import SamplingParams  # noqa: E402

TINY = REPO / "examples" / "tiny-qwen3"


class StubRunner(ModelRunner):
    """A ModelRunner with no model: ``launch`` runs for real, ``_forward`` returns canned hidden states."""

    def __init__(self, config: Config, num_blocks: int, vocab: int) -> None:  # noqa: D107 - no super().__init__
        self.init_host_state(config, torch.device("cpu"), num_blocks)
        # canned hidden states that are their own logits: the "lm_head" is the identity
        self._canned = torch.randn(config.max_num_seqs + config.max_num_batched_tokens, vocab)
        self.model = SimpleNamespace(compute_logits=lambda hidden: hidden)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self._canned[:inputs.input_ids.numel()]


def stub_graphs(runner: StubRunner, sample_in_graph: bool) -> Any:
    """The decode CUDA graphs' host side (staging, the block-table gather) with replays that do nothing."""
    from llmcli.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, staged_bytes, staged_views

    config, vocab = runner.config, runner._canned.shape[1]
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # no model to capture: the buffers DecodeGraphs would make
    graphs.batch_sizes = graph_batch_sizes(config.max_num_seqs)
    top = graphs.batch_sizes[-1]
    graphs.staged = torch.zeros(staged_bytes(top), dtype=torch.uint8)
    graphs.i64, graphs.delta_index, graphs.f32, lens, graphs.delta_blocks = staged_views(graphs.staged, top)
    graphs.tokens = torch.zeros(max(top, config.max_num_seqs), dtype=torch.int64)
    graphs.ring, graphs.sample_in_graph = None, sample_in_graph
    graphs._host_views, graphs._cpu_host = {}, None
    from llmcli.engine.cuda_graphs import _ORDER, _SLOTS, _TABLE_ROWS
    from llmcli.kernels.backend import GraphInputs
    from llmcli.kernels.torch_backend import TorchAttentionBackend

    graphs.backend = TorchAttentionBackend(1, 1, 8, 1.0, config.kvcache_block_size)  # its graph buffers only
    graphs.backend.init_graph_buffers(top, runner.block_tables.width, torch.device("cpu"),
                                      GraphInputs(graphs.i64[_SLOTS], lens, graphs.i64[_ORDER], graphs.i64[_TABLE_ROWS]))
    graphs.graphs = {bs: SimpleNamespace(replay=lambda: None) for bs in graphs.batch_sizes}
    graphs.samplers = {(bs, filtered): SimpleNamespace(replay=lambda: None) for bs in graphs.batch_sizes
                       for filtered in (False, True)}
    graphs.outputs = {bs: runner._canned[:bs] for bs in graphs.batch_sizes}
    return graphs


class StubEngine(LLMEngine):
    graph_mode = "eager"

    def _start_runner(self, config: Config) -> StubRunner:
        runner = StubRunner(config, config.num_kvcache_blocks, vocab=16)  # small: the sampler's CPU arithmetic
        if self.graph_mode != "eager":  # must not hide its host cost
            runner.graphs = stub_graphs(runner, sample_in_graph=self.graph_mode == "graph+sample")
        return runner


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="running sequences (default 256)")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps (default 300)")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--temperature", type=float, default=0.6, help="as the default bench workload (0: greedy)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="the CI smoke test: batch 16, 20 steps")
    p.add_argument("--paths", nargs="+", default=["eager", "graph", "graph+sample"],
                   help="decode paths: eager (no CUDA graphs: prepare_decode + forward), graph (the CUDA-graph "
                        "path's staging, replays stubbed), graph+sample (sample_in_graph)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.steps, args.warmup_steps = 16, 20, 5
    return args


def measure(args: argparse.Namespace) -> dict[str, float]:
    max_out = args.warmup_steps + args.steps + 64  # nobody finishes while we measure
    blocks_per_seq = -(-(1024 + max_out) // args.block_size) + 1
    config = Config(str(TINY), device="cpu", dtype="float32", max_num_seqs=args.batch,
                    kvcache_block_size=args.block_size, num_kvcache_blocks=args.batch * blocks_per_seq,
                    max_model_len=2048)
    StubEngine.graph_mode = args.path
    engine = StubEngine(config)
    engine.step_timer = engine.model_runner.timer
    rng = random.Random(0)
    for i in range(args.batch):
        prompt = [rng.randrange(3, 600) for _ in range(rng.randint(100, 1024))]
        engine.add_request(prompt, SamplingParams(temperature=args.temperature, top_p=1.0, top_k=-1, min_p=0.0,
                                                  repetition_penalty=1.0, max_tokens=max_out, ignore_eos=True, seed=i))
    while engine.scheduler.waiting:  # prefill (stubbed) until every request decodes
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    timer = engine.step_timer
    timer.reset()
    per_step, walls = [], []
    for _ in range(args.steps):
        before = {name: timer.seconds[("decode", name)] for name in HOST_PHASES}
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        per_step.append({name: timer.seconds[("decode", name)] - before[name] for name in HOST_PHASES})
    decode = timer.summary()["decode"]
    assert decode["steps"] == args.steps and decode["tokens"] == args.steps * args.batch, decode
    # the median step of each phase: the machine is shared, and a neighbour's burst lands on a few steps
    row = {name: 1000 * statistics.median(s.get(name, 0.0) for s in per_step) for name in HOST_PHASES}
    row["host"] = 1000 * statistics.median(sum(s.get(p, 0.0) for p in HOST_PHASES) for s in per_step)
    row["host_mean"] = sum(decode.get(f"{name}_ms", 0.0) for name in HOST_PHASES)
    row["step_wall"] = 1000 * statistics.median(walls)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for path in args.paths:
        args.path = path
        rows.append((path, measure(args)))
    print(f"host time per decode step, batch {args.batch}, {args.steps} steps, temperature {args.temperature} "
          f"(stub forward; ms per step, median step)")
    names = list(rows[0][1])
    print(md_table(["path", *names], [[path, *(f"{row[n]:.3f}" for n in names)] for path, row in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
