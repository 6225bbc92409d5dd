"""Tensor-parallel linear layers; each parameter's ``weight_loader`` picks its own shard."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.layers.weight_shape import expect_shape
from llmcli.parallel import all_reduce, tp_rank, tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class LinearBase(nn.Module):
    """y = x W^T (+ b). ``tp_dim`` is the weight dimension split across ranks (None: replicated)."""

    tp_dim: int | None = None
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
        sharded = self.tp_dim is not None and (param.dim() > 1 or self.tp_dim == 0)
        full = list(param.shape)
        if sharded:
            full[self.tp_dim] *= self.tp_size
        expect_shape(loaded, full)
        param.data.copy_(self._shard(loaded, self.tp_dim) if sharded else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.apply(x, bias)
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
        expect_shape(loaded, (self.out_sizes[shard_id], *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 with_v: bool = True) -> None:
        """``with_v=False``: no v projection (Gemma 4's K = V layers use k's output as v)."""
        world = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, world, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, world, "num_key_value_heads")
        out = (num_heads + (2 if with_v else 1) * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias)
        self.weight.packed_shards = ("q", "k", "v") if with_v else ("q", "k")  # the checkpoint tensors it takes
        if bias:
            self.bias.packed_shards = self.weight.packed_shards

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        expect_shape(loaded, (size * self.tp_size, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_divide(in_features, tp_size(), "input features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)

