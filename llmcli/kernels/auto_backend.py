"""Which attention backend ``attention_backend="auto"`` runs on CUDA: the one measured fastest, by rule.

The rule is a table keyed by (compute capability major, head dim), each entry with the measurement behind
it; a GPU generation or head size nobody has measured gets llmcli's own Triton kernels, the backend every
GPU session tests. flash-attn is chosen only where it was measured faster and is installed (and the KV
block size suits it); it stays selectable by name everywhere it runs.
"""
from __future__ import annotations

# (capability major, head dim) -> the faster backend
MEASURED: dict[tuple[int, int], str] = {
    # H200 (sm_90), Qwen3-0.6B and Qwen3-8B (head dim 128), the default bench (256 requests, in/out 100-1024,
    # bf16), 2026-12-02, issue 28: flash-attn 22,881 vs triton 26,028 output tok/s on 0.6B (-12%), 8,876 vs
    # 9,749 on 8B (-9%). benchmarks/real_path_gpu.py re-measures both with the flash-attn wheel installed.
    (9, 128): "triton",
}
UNMEASURED = "triton"


def fastest_backend(capability: tuple[int, int], head_dim: int, flash_available: bool, block_size: int) -> str:
    """'triton' or 'flash-attn' for a GPU of ``capability`` and a model of ``head_dim``."""
    choice = MEASURED.get((capability[0], head_dim), UNMEASURED)
    if choice == "flash-attn" and (not flash_available or block_size % 256):
        return "triton"
    return choice
