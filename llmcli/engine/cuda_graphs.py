"""Decode CUDA graphs: captured once per batch size over static buffers, replayed every decode step.

A step's inputs cross to the device in one copy into those buffers (``staged_replay``); the graph
itself takes in-flight tokens from the last step's samples. With ``sample_in_graph`` a second, small graph
per batch size holds the lm_head and the sampler (two of them: plain and filtered), so that a whole decode
step is two replays and nothing between them.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch
from torch import nn

from llmcli.config import Config
from llmcli.engine.block_tables import BlockTables
from llmcli.engine.pinned import StagingRing
from llmcli.engine.step_inputs import StepInputs
from llmcli.kernels.backend import AttentionBackend, GraphInputs

MAX_GRAPH_BATCH = 512
# staged_replay's inputs, one row each, in this order
I64_ROWS = ("ids", "positions", "slots", "pending", "seeds", "steps", "table_rows", "order", "top_ks")
F32_ROWS = ("temperatures", "min_ps", "top_ps")
_SLOTS, _PENDING, _TABLE_ROWS, _ORDER = (I64_ROWS.index(name) for name in ("slots", "pending", "table_rows", "order"))
_TOP_PS = F32_ROWS.index("top_ps")


GRAPH_SPACINGS = ("spaced", "pow2", "every16")


def staged_bytes(rows: int, groups: int = 1) -> int:
    return rows * (8 * (len(I64_ROWS) + groups - 1) + 8 + 4 * len(F32_ROWS) + 4 + 4)


def staged_views(buf: torch.Tensor, rows: int, groups: int = 1) -> tuple[torch.Tensor, ...]:
    """Views of a uint8 buffer of ``staged_bytes(rows, groups)`` (on the device, or its pinned host copy): the
    int64 rows [len(I64_ROWS) + groups - 1, rows] (after I64_ROWS, the slots of KV groups 1..), the block-table
    deltas' int64 flat indices [rows], the float32 rows [len(F32_ROWS), rows], the int32 context lengths [rows]
    and the deltas' int32 block ids [rows]."""
    sizes = [(torch.int64, len(I64_ROWS) + groups - 1), (torch.int64, 1), (torch.float32, len(F32_ROWS)),
             (torch.int32, 1), (torch.int32, 1)]
    views, at = [], 0
    for dtype, count in sizes:
        nbytes = dtype.itemsize * count * rows
        view = buf[at:at + nbytes].view(dtype)
        views.append(view.view(count, rows) if count > 1 else view)
        at += nbytes
    return tuple(views)


def graph_batch_sizes(max_num_seqs: int, spacing: str | None = None) -> list[int]:
    """The decode batch sizes that get a CUDA graph; a step of n rows replays the smallest one of at least n.

    ``spacing`` (default: ``LLMCLI_GRAPH_SIZES``, else ``"spaced"``):

    - ``"spaced"``: 1, 2, 4, 8, 16, then powers of two and the midpoints between them (32, 48, 64, 96, 128,
      192, ...): 14 graphs at 512 rows, and a padded step runs at most 1.5x its rows. Decode GEMMs of up to a
      few hundred rows cost what their weights cost to read, and padding rows attend to nothing, so the
      padding is nearly free while each graph fewer saves its capture at start-up.
    - ``"pow2"``: powers of two only (10 graphs at 512; up to 2x the rows).
    - ``"every16"``: 1, 2, 4, 8 and every multiple of 16 (36 graphs at 512; the least padding).
    - a comma-separated list of sizes (for measurements).

    Every size is 1, 2, 4, 8 or a multiple of 16, like the sizes a real step would otherwise pad to, so the
    kernels compiled for the graphs are the usual ones. The largest decode batch always gets a graph.
    """
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    spacing = (spacing if spacing is not None else os.environ.get("LLMCLI_GRAPH_SIZES", "")).strip() or "spaced"
    if spacing[:1].isdigit():
        try:
            listed = {int(part) for part in spacing.split(",") if part.strip()}
        except ValueError:
            raise ValueError(f"LLMCLI_GRAPH_SIZES={spacing!r}: expected {', '.join(GRAPH_SPACINGS)} "
                             "or a comma-separated list of batch sizes") from None
        return sorted({b for b in listed if 0 < b < top} | {top})
    small = [b for b in (1, 2, 4, 8, 16) if b < top]
    if spacing == "every16":
        sizes = small[:4] + list(range(16, top, 16))
    elif spacing == "pow2":
        sizes = small + [1 << i for i in range(5, 10)]
    elif spacing == "spaced":
        sizes = small + [b for i in range(5, 10) for b in (1 << i, 3 << (i - 1))]  # 32, 48, 64, 96, ...
    else:
        raise ValueError(f"LLMCLI_GRAPH_SIZES={spacing!r}: expected {', '.join(GRAPH_SPACINGS)} "
                         "or a comma-separated list of batch sizes")
    return sorted({b for b in sizes if b < top} | {top})


class DecodeGraphs:
    """The model's forward for each decode batch size, and with ``sample_in_graph`` its lm_head and sampler.

    Graphs are captured largest first into one shared memory pool. A step of
    ``n`` sequences replays the smallest graph of at least ``n`` rows; the
    padding rows have slot -1 and context length 0, so they store nothing.

    The sampler has a graph of its own, after the forward's, in two kinds per batch size: ``plain`` (the
    one-pass draw, min-p its only filter) and ``filtered`` (each row's top-k/top-p threshold first, from
    ``torch.topk``'s 64 largest logits and ``llmcli.kernels.triton_sample_filter``). One sampler graph that
    always filters would make every unfiltered step pay that top-k: at batch 256 over Qwen3's 151,936 logits
    it reads 78 MB of bf16 a few times over (radix select), ~0.1-0.2 ms, 2-3% of a 0.6B decode step; and
    two whole graphs per batch size (forward included) would double the capture of the forward, the costly
    part of start-up's graphs phase (0.5-1 s for 14 sizes). A sampler graph is a handful of kernels: the 28
    of them add little to start-up, and a step replays one more graph (a few microseconds). Unused rows of
    a step (top-k off, top-p 1) cost the filtered kernel nothing but its window.
    """

    groups = 1  # KV groups (engine/kv_groups.py): each has its slots in the staged inputs and its block tables

    def __init__(self, model: nn.Module, backend: AttentionBackend, config: Config, device: torch.device,
                 sample_in_graph: bool = False, groups: int = 1) -> None:
        """``groups``: the model's KV groups (engine/kv_groups.py), each with its slots and block tables."""
        if backend.name == "torch":
            raise ValueError("CUDA graphs need the triton or flash-attn backend (set enforce_eager=True for torch)")
        self.model, self.backend = model, backend
        self.batch_sizes = graph_batch_sizes(config.max_num_seqs)
        top = self.batch_sizes[-1]
        max_blocks = -(-config.max_model_len // config.kvcache_block_size)
        # every per-row input in one buffer (int64 rows, float32 rows, int32 context lengths), so that a step's
        # inputs cross in one copy (staged_replay)
        self.groups = groups
        self.staged = torch.zeros(staged_bytes(top, groups), dtype=torch.uint8, device=device)
        self.i64, self.delta_index, self.f32, lens, self.delta_blocks = staged_views(self.staged, top, groups)
        self.input_ids, self.positions = self.i64[0], self.i64[1]
        # where in-flight tokens are read from: the previous step's tokens are copied in whole, and a step may
        # sample up to max_num_seqs rows (a mixed step, or an eager decode step wider than the largest graph)
        self.tokens = torch.zeros(max(top, config.max_num_seqs), dtype=torch.int64, device=device)
        # the attention reads its per-row inputs from the staged buffer (one copy a step); its block tables are
        # its own (gather_graph_tables)
        group_slots = tuple(self.i64[len(I64_ROWS) + g] for g in range(groups - 1))
        backend.init_graph_buffers(top, max_blocks, device, GraphInputs(self.i64[_SLOTS], lens, self.i64[_ORDER],
                                                                        self.i64[_TABLE_ROWS], group_slots),
                                   groups)
        self.i64[_ORDER].copy_(torch.arange(top))  # a permutation from the start (capture launches every row)
        self.i64[_TABLE_ROWS].fill_(-1)  # padding rows: no row
        self.f32[_TOP_PS].fill_(1.0)  # top-p off in every row until a step says otherwise
        self.ring = StagingRing() if device.type == "cuda" else None
        self._host_views: dict[int, tuple[np.ndarray, ...]] = {}  # numpy views of each staging buffer
        self._cpu_host: torch.Tensor | None = None
        self.sample_in_graph = sample_in_graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # or anything with replay() and reset(): see _capture
        self.outputs: dict[int, torch.Tensor] = {}
        self.samplers: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, filtered) -> graph
        free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        self.i64[_PENDING].fill_(-1)
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):
                backend.prepare_for_capture(bs)
                self._body(bs)  # warm-up: compilation and autotuning
                self.graphs[bs], self.outputs[bs], pool = self._capture(bs, self._body, pool)
                for filtered in (False, True) if sample_in_graph else ():
                    body = self._sampler_body(filtered)
                    body(bs)  # warm-up
                    self.samplers[bs, filtered], _, pool = self._capture(bs, body, pool)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else 0

    def _capture(self, bs: int, body: Callable[[int], torch.Tensor], pool: object,
                 ) -> tuple[object, torch.Tensor, object]:
        """(graph of ``body(bs)``, its output, the memory pool the next capture shares); tests replace it with
        eager replays."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            output = body(bs)
        return graph, output, graph.pool() if pool is None else pool

    def _body(self, bs: int) -> torch.Tensor:
        """In-flight tokens from ``self.tokens`` and the forward; returns the hidden states."""
        row = dict(zip(I64_ROWS, self.i64[:, :bs]))
        pending = row["pending"]
        # clamped: a row flagged non-finite (-1) computes one throw-away token before its request fails
        ids = torch.where(pending >= 0, self.tokens[pending.clamp(min=0)].clamp(min=0), row["ids"])
        return self.model(ids, row["positions"])

    def _sampler_body(self, filtered: bool) -> Callable[[int], torch.Tensor]:
        """The lm_head over the forward's hidden states and the draw (``sample_one_pass``: the very kernels
        the sampler runs outside the graph, so a seeded row draws the same token either way), written to
        ``self.tokens``; the forward's graph of the same size must be captured first."""
        from llmcli.layers.sampler import sample_one_pass

        def body(bs: int) -> torch.Tensor:
            row = dict(zip(I64_ROWS, self.i64[:, :bs]))
            temperatures, min_ps, top_ps = (self.f32[F32_ROWS.index(name), :bs] for name in
                                            ("temperatures", "min_ps", "top_ps"))
            logits = self.model.compute_logits(self.outputs[bs])
            tokens = sample_one_pass(logits, temperatures, row["top_ks"], top_ps, min_ps, row["seeds"],
                                     row["steps"], filtered)
            self.tokens[:bs].copy_(tokens)
            return tokens
        return body

    def release(self) -> None:
        """Free every graph now (a graph holding collectives must go before its communicator)."""
        for graph in (*self.samplers.values(), *self.graphs.values()):
            graph.reset()
        self.samplers.clear()
        self.graphs.clear()
        self.outputs.clear()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """The forward of a decode step prepared as device tensors (``prepare_decode``), its in-flight tokens
        already filled in; the engine's own steps use ``staged_replay`` (benchmarks time this one)."""
        n = inputs.input_ids.numel()
        bs = next(b for b in self.batch_sizes if b >= n)
        self.i64[_PENDING, :bs].fill_(-1)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.backend.prepare_for_replay(inputs.metadata, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    @property
    def max_deltas(self) -> int:
        """Most block-table deltas ``staged_replay`` takes along (a step with more sends them on its own)."""
        return self.delta_index.numel()

    def staged_replay(self, i64: np.ndarray, f32: np.ndarray | None, lens: np.ndarray,
                      tables: BlockTables | list[BlockTables],
                      prev_tokens: torch.Tensor | None, deltas: tuple[np.ndarray, np.ndarray] | None = None,
                      filtered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``n`` sequences: (sampled tokens if ``sample_in_graph``, hidden states), n rows each.

        ``i64`` [len(I64_ROWS) + groups - 1, n] and ``f32`` [len(F32_ROWS), n] (None: not sampling in the graph)
        hold the step's inputs and ``lens`` its context lengths: one copy to the device, one gather of block-table
        rows from ``tables`` (per KV group: a list, the deltas are the first group's), the forward's replay and (with ``f32``) the sampler's, the ``filtered`` one
        when some row has top-k or top-p. ``prev_tokens``: the last step's samples when they are not in
        ``self.tokens`` already (its in-flight tokens come from them). ``deltas``: the block tables' pending
        deltas (``BlockTables.sync(defer=True)``, at most ``max_deltas``), staged with the rest and applied
        before the gather.
        """
        n, top = i64.shape[1], self.i64.shape[1]
        bs = next(b for b in self.batch_sizes if b >= n)
        nbytes = self.staged.numel()
        if self.ring is not None:
            host = self.ring.take(nbytes)
        else:  # the CPU stand-in: copies are synchronous, one buffer will do
            if self._cpu_host is None:
                self._cpu_host = torch.empty(nbytes, dtype=torch.uint8)
            host = self._cpu_host
        views = self._host_views.get(host.data_ptr())  # a ring hands out the same few buffers: view them once
        if views is None:
            views = self._host_views[host.data_ptr()] = tuple(t.numpy() for t in staged_views(host, top, self.groups))
        host_i64, host_index, host_f32, host_lens, host_blocks = views
        m = 0 if deltas is None else len(deltas[0])
        if m:
            host_index[:m], host_blocks[:m] = deltas
        # rows n..bs are the graph's padding rows (rows past bs are not read): they store nothing, attend to
        # nothing, and read no in-flight token
        host_i64[:, :n] = i64
        host_i64[:, n:bs] = 0
        host_i64[_SLOTS, n:bs] = -1
        host_i64[len(I64_ROWS):, n:bs] = -1  # the other KV groups' slots
        host_i64[_PENDING, n:bs] = -1
        host_i64[_TABLE_ROWS, n:bs] = -1
        host_i64[_ORDER, n:bs] = np.arange(n, bs)  # after the real rows (longest first), as the shortest
        host_lens[:n] = lens
        host_lens[n:bs] = 0
        if f32 is not None:  # padding rows: greedy, every filter off (top-k 0 above, top-p 1)
            host_f32[:, :n] = f32
            host_f32[:, n:bs] = 0
            host_f32[_TOP_PS, n:bs] = 1.0
        if prev_tokens is not None:
            self.tokens[:prev_tokens.numel()].copy_(prev_tokens, non_blocking=True)
        self.staged.copy_(host, non_blocking=True)
        if self.ring is not None:
            self.ring.copied()
        groups = tables if isinstance(tables, list) else [tables]
        if m:
            groups[0].apply(self.delta_index[:m], self.delta_blocks[:m])
        self.backend.gather_graph_tables(groups[0].table, self.i64[_TABLE_ROWS, :n], tuple(t.table for t in groups[1:]))
        self.graphs[bs].replay()  # (the backend's metadata is a Python-side thing the replay never reads)
        if f32 is not None:
            self.samplers[bs, filtered].replay()
        return self.tokens[:n], self.outputs[bs][:n]
