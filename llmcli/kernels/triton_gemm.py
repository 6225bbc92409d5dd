"""Thin-M GEMMs in Triton: ``x @ w.T`` for the few rows of a decode step, optionally with SiLU-and-mul fused in.

``silu_mul_linear(x, w)`` takes the merged gate/up weight ``w`` = [gate; up] ([2I, K]) and returns
``silu(x @ gate.T) * (x @ up.T)`` ([M, I]) without writing the [M, 2I] projection out and reading it back:
each program holds one tile of the gate and the matching tile of the up projection. ``linear(x, w)`` is the
same kernel without the epilogue (``decode_gemm=triton``: every decode GEMM but the LM head).

A decode GEMM reads each weight once and does little arithmetic per byte: its speed is the number of bytes
the GPU keeps in flight. 0.6B's o and down projections have 1,024 output columns, 16 tiles of 64: far too few
programs for 132 SMs. So K is cut into ``splits`` ranges as well (split-K, about ``PROGRAMS_PER_SM`` programs
per SM): each program writes its float32 partial tile to a scratch buffer and bumps the tile's arrival counter
(acq_rel, GPU scope); the last to arrive sums the partials in split order (deterministic whatever the arrival
order), applies the epilogue, stores, and sets the counter back to 0 for the next launch or graph replay.
Splits are capped so that the partials' traffic stays under a quarter of the weight bytes, which leaves
batches above ~64 rows with few or no splits. Row tiles hold at most 64 rows, so a bigger batch reads each
weight tile once per 64 rows; ``GemmTuning.max_block_m`` lets benchmarks try 128-256-row tiles (a third
faster on 8B at batch 128-256, still 26-53% behind cuBLAS: run 48).

With programmatic dependent launch (``llmcli.kernels.pdl``) a program first asks L2 for its weight slice,
which never depends on the previous kernel, while that kernel finishes; then waits for it
(``griddepcontrol.wait``) and only then reads ``x``.

Measured on an H200 (benchmarks/RESULTS.md runs 32-33, ``benchmarks/decode_gemm_gpu.py``): within ~5% of cuBLAS
on 0.6B's projections at batch 1-64 (both ~1.0-1.3 TB/s: each GEMM is a few microseconds of weights), slower at
256 and on 8B, with or without PDL; so ``decode_gemm`` defaults to ``cublas``.

The scratch buffer and counters are one pair per device, shared by every call: kernels on one stream run one
after another (with PDL too: nothing touches them before the wait), which is how the engine launches them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmcli.kernels import MAX_THIN_M  # noqa: F401 - the limit callers check
from llmcli.kernels import pdl

PROGRAMS_PER_SM = 2  # split K until about this many programs per SM
SCRATCH_NUMEL = 4 << 20  # float32 partials per device (16 MiB): a split that needs more uses fewer splits
COUNTERS_NUMEL = 1 << 15  # tile arrival counters per device


@dataclass(frozen=True)
class GemmTuning:
    """Launch settings of the thin GEMM (benchmarks sweep others)."""

    block_n: int = 64
    block_k: int = 128
    programs_per_sm: int = PROGRAMS_PER_SM
    prefetch: bool = True  # with PDL: the weight slice to L2 before the wait
    # rows per tile at most (16, 32, ... as the batch needs): above 64 each weight tile is read by fewer row
    # tiles (8B's decode GEMMs at batch 128-256 read their weights 2-4 times at 64); experimental
    max_block_m: int = 64
    num_warps: int = 4


DEFAULT_TUNING = GemmTuning()


@triton.jit
def _prefetch_l2(ptrs, mask, fallback):
    """Ask L2 for the cache lines at ``ptrs`` (masked-off lanes ask for ``fallback``, a valid address)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, fallback)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_tile(out_ptr, acc, acc_up, rm, rn, mask, stride_om, SILU_MUL: tl.constexpr):
    if SILU_MUL:
        # the reference rounds each projection to the model dtype before the activation
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = silu * up
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


# The batch and the split sizes change with every step size: one compiled kernel for all of them.
@triton.jit(do_not_specialize=["M", "tiles_per_split", "splits"])
def _thin_gemm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, counters_ptr, M, N, K, up_offset, tiles_per_split, splits,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # a split starts at a whole number of BLOCK_K tiles: the compiler sees the alignment and vectorises the
    # loads (with a split size in elements it could not, and the kernel ran several times slower)
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    w_rows = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    if PDL:
        if PREFETCH:
            lines = tl.arange(0, BLOCK_K // LINE) * LINE
            for k0 in range(k_start, k_end, BLOCK_K):
                ok = n_ok[None, :] & ((k0 + lines) < k_end)[:, None]
                _prefetch_l2(w_rows + (k0 + lines)[:, None], ok, w_ptr)
                if SILU_MUL:
                    _prefetch_l2(w_rows + up_offset * stride_wn + (k0 + lines)[:, None], ok, w_ptr)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # after the wait: a dependent past its own wait knows we are done
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = ((k0 + rk) < k_end) | EVEN_K  # K a multiple of BLOCK_K (every model's): no mask along K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + rk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
        if SILU_MUL:
            w_up = tl.load(w_rows + up_offset * stride_wn + (k0 + rk)[:, None], mask=n_ok[None, :] & k_ok[:, None],
                           other=0.0)
            acc_up = tl.dot(x, w_up, acc_up)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        # partials: [splits, tiles, (gate, up), BLOCK_M, BLOCK_N] float32, one contiguous block per program
        tile = pid_m * tl.num_programs(0) + pid_n
        num_tiles = tl.num_programs(0) * tl.num_programs(2)
        parts = 2 if SILU_MUL else 1
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_size = parts * BLOCK_M * BLOCK_N
        mine = part_ptr + (pid_k * num_tiles + tile).to(tl.int64) * tile_size + local
        tl.store(mine, acc, mask=mask)
        if SILU_MUL:
            tl.store(mine + BLOCK_M * BLOCK_N, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the (one-thread) release of the counter
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last program of this tile: every partial is in
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            first = part_ptr + tile.to(tl.int64) * tile_size + local
            split_stride = num_tiles.to(tl.int64) * tile_size
            for s in range(0, splits):  # in split order, so the sum's rounding never depends on arrival order
                src = first + s * split_stride
                acc += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")  # L2, never a stale L1 line
                if SILU_MUL:
                    acc_up += tl.load(src + BLOCK_M * BLOCK_N, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(out_ptr, acc, acc_up, rm, rn, mask, stride_om, SILU_MUL)
            tl.store(counters_ptr + tile, 0)  # nobody else touches it in this launch; the next one sees 0
    else:
        _store_tile(out_ptr, acc, acc_up, rm, rn, mask, stride_om, SILU_MUL)


def _block_m(m: int, cap: int = 64) -> int:
    return min(cap, max(16, triton.next_power_of_2(m)))


SMEM_BUDGET = 200 << 10  # bytes of pipelined tiles per program (an H200 SM has 227 KiB)


def _num_stages(block_m: int, block_n: int, block_k: int, parts: int, itemsize: int) -> int:
    """Pipeline depth: four stages of the default bf16 tiles, two of float32 (four need 256 KiB at BLOCK_M 64:
    Triton's OutOfResources in run 23's kernels stage), and bigger tiles as many as the budget holds (run 48:
    BLOCK_N 128 at BLOCK_M 64 asked for 320 KiB)."""
    per_stage = (block_m + parts * block_n) * block_k * itemsize
    return max(2, min(4 if itemsize <= 2 else 2, SMEM_BUDGET // per_stage))


_scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_num_sms: dict[torch.device, int] = {}


def _device_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This device's partials scratch, zeroed counters and SM count (made once, kept for the process: CUDA
    graphs captured with them keep pointing at them)."""
    if device not in _scratch:
        _scratch[device] = (torch.empty(SCRATCH_NUMEL, dtype=torch.float32, device=device),
                            torch.zeros(COUNTERS_NUMEL, dtype=torch.int32, device=device))
        _num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 8
    part, counters = _scratch[device]
    return part, counters, _num_sms[device]


def choose_splits(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, num_sms: int,
                  parts: int = 1, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(splits, K tiles per split) for an [m, k] x [k, n] product: split K until about ``programs_per_sm``
    programs per SM, while the float32 partials (written once, read once: 8·splits·m·n bytes) stay under a
    quarter of the weight bytes (2·n·k) and fit the scratch. ``programs_per_sm`` 0: no split."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    chunks = triton.cdiv(k, block_k)
    wanted = triton.cdiv(programs_per_sm * num_sms, tiles)
    by_traffic = k // (16 * m)
    by_scratch = SCRATCH_NUMEL // (tiles * parts * block_m * block_n)
    splits = max(1, min(wanted, chunks, by_traffic, by_scratch))
    if tiles > COUNTERS_NUMEL:
        splits = 1
    per_split = triton.cdiv(chunks, splits)
    return triton.cdiv(chunks, per_split), per_split


def _run(x: torch.Tensor, w: torch.Tensor, n: int, silu_mul: bool, tuning: GemmTuning) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1 and x.shape[1] == w.shape[1]
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    part, counters, num_sms = _device_state(x.device)
    block_m, block_n, block_k = _block_m(m, tuning.max_block_m), tuning.block_n, tuning.block_k
    splits, tiles_per_split = choose_splits(m, n, k, block_m, block_n, block_k, num_sms, 2 if silu_mul else 1,
                                        tuning.programs_per_sm)
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
    use_pdl = pdl.enabled()
    _thin_gemm_kernel[grid](x, w, out, part, counters, m, n, k, n, tiles_per_split, splits,
                            x.stride(0), w.stride(0), out.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, SPLIT=splits > 1,
                            EVEN_K=k % block_k == 0,
                            PDL=use_pdl, PREFETCH=tuning.prefetch, LINE=128 // w.element_size(),
                            num_warps=tuning.num_warps,
                            num_stages=_num_stages(block_m, block_n, block_k, 2 if silu_mul else 1, x.element_size()),
                            **pdl.options())
    return out


def linear(x: torch.Tensor, w: torch.Tensor, tuning: GemmTuning = DEFAULT_TUNING) -> torch.Tensor:
    """``x @ w.T`` ([M, K] x [N, K] -> [M, N])."""
    return _run(x, w, w.shape[0], False, tuning)


def silu_mul_linear(x: torch.Tensor, w: torch.Tensor, tuning: GemmTuning = DEFAULT_TUNING) -> torch.Tensor:
    """``silu(x @ w[:I].T) * (x @ w[I:].T)`` for a merged gate/up weight ``w`` of 2I rows."""
    assert w.shape[0] % 2 == 0
    return _run(x, w, w.shape[0] // 2, True, tuning)
