"""Compiling Triton kernels on worker threads while start-up's main thread runs the probe and the compile pass.

Triton compiles a kernel variant the first time a launch needs it, and on a fresh machine most of that time
is spent waiting for ptxas subprocesses; start-up used to meet the variants one after another. The sampler,
row-key, logprobs and attention kernels need only tensors of the right shapes, strides and dtypes,
so worker threads launch each once on small dummies while the main thread runs the memory probe and the
prefill variants; on a warm cache each launch just loads its kernel. Best effort by design: whatever the
threads miss or fail on, the main thread's own passes (``warmup.compile_variants``, graph capture)
still compile before any real step. The dummies take well under 100 MiB, so the probe's activation peak (hence the KV pool) moves by less.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


log = logging.getLogger("llmcli")
Task = Callable[[], object]


def _dummy_logits(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Spread-out values without touching the default random generator (the main thread may be using it)."""
    ids = torch.arange(rows * vocab_size, device=device, dtype=torch.float32).view(rows, vocab_size)
    return torch.sin(ids * 0.618) * 4


def kernel_tasks(vocab_size: int, dtype: torch.dtype, device: torch.device) -> list[Task]:
    """Launches that compile the sampler and logprobs kernels, on dummies of the real shapes."""
    from llmcli.kernels.triton_logprobs import token_logprobs_triton
    from llmcli.kernels.triton_sample import row_keys, sample_unfiltered
    from llmcli.kernels.triton_sample_filter import thresholds

    rows = 4
    tasks: list[Task] = []

    def sampler(logits_dtype: torch.dtype) -> Task:
        def run() -> object:
            logits = _dummy_logits(rows, vocab_size, device).to(logits_dtype)
            temps = torch.ones(rows, device=device)
            keys = row_keys(torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device))
            top_ks = torch.full((rows,), 20, dtype=torch.int64, device=device)
            return sample_unfiltered(logits, temps, temps * 0.05, keys), thresholds(logits, temps, top_ks, temps * 0.9)
        return run

    tasks += [sampler(dtype), sampler(torch.float32)]  # the draw and the top-k/top-p thresholds

    def logprobs(k: int) -> Task:
        def run() -> object:
            logits = _dummy_logits(rows, vocab_size, device).to(dtype)
            return token_logprobs_triton(logits, logits.argmax(dim=-1), k)
        return run

    tasks += [logprobs(1), logprobs(5)]
    return tasks


def attention_tasks(backend: object, dtype: torch.dtype, device: torch.device, max_model_len: int,
                    max_num_batched_tokens: int, graph_batch_sizes: list[int],
                    kv_dtype: torch.dtype | None = None) -> list[Task]:
    """Launches that compile the Triton attention kernels start-up meets later: the prefill variants of
    ``warmup.compile_variants`` (varlen and paged, short and long chunks) and one decode launch per
    split count the decode graphs will use. Inputs are small dummies with the real strides; nothing is stored.
    ``kv_dtype``: the KV pool's element type (an FP8 cache compiles other variants), by default ``dtype``."""
    if getattr(backend, "name", None) != "triton":
        return []
    from llmcli.kernels.triton_decode import paged_decode
    from llmcli.kernels.triton_prefill import prefill_paged, prefill_varlen

    heads, kv_heads, dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    bs, scale = backend.block_size, backend.scale
    max_blocks = -(-max_model_len // bs)
    i32 = dict(dtype=torch.int32, device=device)

    def prefill(q_len: int, k_len: int) -> Task:
        def run() -> object:
            q = torch.zeros(q_len, heads, dim, dtype=dtype, device=device)
            cu_q = torch.tensor([0, q_len], **i32)
            k = torch.zeros(q_len, kv_heads, dim, dtype=dtype, device=device)
            if k_len == q_len:
                return prefill_varlen(q, k, k, cu_q, q_len, scale)
            blocks = -(-k_len // bs)
            cache = torch.zeros(blocks, bs, kv_heads, dim, dtype=kv_dtype or dtype, device=device)
            table = torch.arange(blocks, **i32)[None, :]  # as warmup.prefill_metadata builds it: one row
            return prefill_paged(q, k, k, cache, cache, table, cu_q, torch.tensor([k_len], **i32), q_len, scale)
        return run

    tasks: list[Task] = []
    biggest = min(max_num_batched_tokens, max_model_len - 1)
    for q_len in sorted({min(n, biggest) for n in backend.prefill_variant_lengths}):
        tasks.append(prefill(q_len, q_len))
        k_len = q_len + min(bs, max_model_len - q_len)
        if k_len > q_len:
            tasks.append(prefill(q_len, k_len))

    def decode(num_splits: int) -> Task:
        def run() -> object:
            q = torch.zeros(1, heads, dim, dtype=dtype, device=device)
            cache = torch.zeros(1, bs, kv_heads, dim, dtype=kv_dtype or dtype, device=device)
            table = torch.zeros(1, max_blocks, **i32)  # the graphs' table buffer is max_blocks wide
            tuning = backend.decode_tuning_for(dim)
            order = torch.zeros(1, dtype=torch.int64, device=device) if tuning.heads_fastest else None
            return paged_decode(q, cache, cache, table, torch.zeros(1, **i32), scale, num_splits=num_splits,
                                tuning=tuning, row_order=order)
        return run

    # one launch per compiled variant: split or not, and how Triton specializes the count itself (1, a
    # multiple of 16, other); the reduce reads every split as one MAX_SPLITS-wide tile, so the count sets no block width
    variants: dict[tuple, int] = {}
    for b in graph_batch_sizes:
        n = backend._splits_for(b, max_blocks * bs, device)
        variants.setdefault((n > 1, n % 16 == 0), n)
    tasks += [decode(n) for n in variants.values()]
    return tasks


class SideCompile:
    """Runs ``tasks`` on a few worker threads (CUDA device set, inference mode) until ``join``."""

    def __init__(self, tasks: list[Task], device: torch.device, workers: int | None = None) -> None:
        self.device = device
        workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1, len(tasks)))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmcli-compile")
        self._futures: list[Future] = [self._pool.submit(self._run, task) for task in tasks]

    def _run(self, task: Task) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with torch.inference_mode():
            task()

    def join(self, cancel: bool = False) -> int:
        """Wait for every task (and the device work they queued); returns how many failed (logged, not raised).
        ``cancel``: drop the tasks not started yet (start-up is failing or being interrupted). A second call
        returns 0 at once."""
        failed = 0
        futures, self._futures = self._futures, []
        if cancel:
            for future in futures:
                future.cancel()
        for future in futures:
            if future.cancelled():
                continue
            exc = future.exception()
            if exc is not None:
                failed += 1
                log.debug("side compile task failed (the main thread compiles it instead): %r", exc)
        self._pool.shutdown(wait=True)
        if self.device.type == "cuda" and not cancel:  # on the way out of a failed start-up, raise nothing new
            torch.cuda.synchronize(self.device)
        return failed
