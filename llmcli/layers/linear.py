"""Tensor-parallel linear layers; each parameter's ``weight_loader`` picks its own shard."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.kernels import MAX_THIN_M

from llmcli.parallel import all_reduce, tp_rank, tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class LinearBase(nn.Module):
    """y = x W^T (+ b). ``tp_dim`` is the weight dimension split across ranks (None: replicated)."""

    tp_dim: int | None = None
    thin_gemm = False  # set by use_thin_gemm: few-row inputs go through llmcli's Triton GEMM instead of cuBLAS
    fp8 = None  # layers.quantization.fp8.Fp8Linear once the weights are FP8 (set after loading, sm90+)

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and (param.dim() > 1 or self.tp_dim == 0):
            loaded = self._shard(loaded, self.tp_dim)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.apply(x, bias)
        if self.thin_gemm and x.shape[0] <= MAX_THIN_M:
            from llmcli.kernels.triton_gemm import linear as thin_linear

            y = thin_linear(x.contiguous(), self.weight)
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    tp_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, tp_size(), "output features"), bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        world = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, world, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, world, "num_key_value_heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias)

    # Set only while llmcli.engine.prefill_graphs captures: every layer's q/k/v land in this one flat buffer (the
    # GEMM writes it directly), so that the eager attention call between two captured pieces reads a fixed
    # address that no piece's memory pool has to keep alive for it.
    static_out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = QKVParallelLinear.static_out
        if out is None or self.bias is not None or x.dim() != 2 or self.fp8 is not None:
            return super().forward(x)
        m, n = x.shape[0], self.weight.shape[0]
        return torch.mm(x, self.weight.t(), out=out[:m * n].view(m, n))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_divide(in_features, tp_size(), "input features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)


DECODE_GEMMS = ("cublas", "triton-silu", "triton")


def use_thin_gemm(model: nn.Module, mode: str) -> None:
    """Route GEMMs of at most MAX_THIN_M rows (decode steps) through Triton: ``triton-silu`` only the gate/up
    projection with SiLU-and-mul fused in (models that support it: a ``fused_silu_gemm`` attribute on their MLP),
    ``triton`` that and every other linear layer; ``cublas`` none."""
    if mode not in DECODE_GEMMS:
        raise ValueError(f"decode GEMM {mode!r} is not one of {', '.join(DECODE_GEMMS)}")
    for module in model.modules():
        if hasattr(module, "fused_silu_gemm"):
            module.fused_silu_gemm = mode != "cublas"
        if isinstance(module, LinearBase):
            module.thin_gemm = mode == "triton"
