"""Attention backends (torch reference, triton, flash-attn) and the Triton kernels behind them."""
from __future__ import annotations

from llmcli.kernels.backend import AttentionBackend, AttentionMetadata


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of the backend called ``name``, importing only its module (Config reads its block-size rules
    before anything is built; flash_attn itself is imported by the instance, not here)."""
    if name == "torch":
        from llmcli.kernels.torch_backend import TorchAttentionBackend as cls
    elif name == "triton":
        from llmcli.kernels.triton_backend import TritonAttentionBackend as cls
    elif name == "flash-attn":
        from llmcli.kernels.flash_backend import FlashAttentionBackend as cls
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    return cls


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int) -> AttentionBackend:
    """Build the backend called ``name`` (already resolved from 'auto' by Config)."""
    return backend_class(name)(num_heads, num_kv_heads, head_dim, scale, block_size)


__all__ = ["AttentionBackend", "AttentionMetadata", "backend_class", "make_backend"]
