"""Vocabulary-parallel token embedding and the output head (logits gathered on rank 0)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmcli.layers.weight_shape import expect_shape
from llmcli.parallel import all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; ids outside it look up zeros."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, (self.vocab_size, param.shape[1]))
        part = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0]:].zero_()  # padding rows of the last shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the given hidden states; with several ranks the full row lands on rank 0 only."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits[:, : self.vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size] if self.tp_rank == 0 else None
