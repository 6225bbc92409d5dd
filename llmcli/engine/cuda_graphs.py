"""Decode CUDA graphs: captured once per batch size over static buffers, replayed every decode step."""
from __future__ import annotations

import os

import torch
from torch import nn

from llmcli.config import Config
from llmcli.engine.step_inputs import StepInputs
from llmcli.kernels.backend import AttentionBackend

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, spacing: str | None = None) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to the largest decode batch.

    ``spacing="pow2"`` (or ``LLMCLI_GRAPH_SIZES=pow2``) captures powers of two only (and the largest batch):
    a third of the graphs, so a shorter start-up, for up to twice the rows in a padded decode step.
    """
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    spacing = spacing if spacing is not None else os.environ.get("LLMCLI_GRAPH_SIZES", "")
    if spacing == "pow2":
        return sorted({b for b in (1 << i for i in range(10)) if b < top} | {top})
    sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16)) + [top]
    return sorted(set(sizes))


class DecodeGraphs:
    """The model's forward (not the lm_head or the sampler) for each decode batch size.

    Graphs are captured largest first into one shared memory pool. A step of
    ``n`` sequences replays the smallest graph of at least ``n`` rows; the
    padding rows have slot -1 and context length 0, so they store nothing.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, config: Config, device: torch.device) -> None:
        if backend.name == "torch":
            raise ValueError("CUDA graphs need the triton or flash-attn backend (set enforce_eager=True for torch)")
        self.model, self.backend = model, backend
        self.batch_sizes = graph_batch_sizes(config.max_num_seqs)
        top = self.batch_sizes[-1]
        max_blocks = -(-config.max_model_len // config.kvcache_block_size)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        backend.init_graph_buffers(top, max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):
                backend.prepare_for_capture(bs)
                model(self.input_ids[:bs], self.positions[:bs])  # warm-up: compilation and autotuning
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.outputs[bs] = model(self.input_ids[:bs], self.positions[:bs])
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])

    def release(self) -> None:
        """Free every graph now (a graph holding collectives must go before its communicator)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        n = inputs.input_ids.numel()
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.backend.prepare_for_replay(inputs.metadata, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
