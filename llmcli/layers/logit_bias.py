"""Per-request logit bias on the device: logit_bias, allowed_token_ids and banned tokens, and min_tokens.

Each request that biases tokens owns one row of a [rows, vocab] float32 table, written once when the
request first samples: 0 everywhere (-inf where ``allowed_token_ids`` leaves a token out), the request's
``logit_bias`` added, -inf on banned tokens. A step adds the rows to its logits. ``min_tokens`` needs no
table: the step sends the few (logit row, token id) pairs of EOS and stop tokens to hold back.
"""
from __future__ import annotations

import torch

from llmcli.layers.penalties import grow_rows


class BiasTables:
    """The device table, grown on demand (a request without a bias never touches it)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.bias = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        return self.bias.shape[0]

    def reserve(self, rows: int) -> None:
        self.bias = grow_rows(self.bias, rows)

    def start(self, rows: torch.Tensor, closed: torch.Tensor, allow: tuple[torch.Tensor, torch.Tensor],
              add: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ban: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Fill rows taken by new requests. ``closed`` [len(rows)] bool: the row allows only the tokens listed
        in ``allow`` (row, id); ``add`` (row, id, value): logit_bias; ``ban`` (row, id): never sampled."""
        base = torch.where(closed, float("-inf"), 0.0).to(torch.float32)
        self.bias[rows] = base[:, None].expand(-1, self.vocab_size)
        self.bias[allow] = 0.0
        self.bias.index_put_(add[:2], add[2], accumulate=True)
        self.bias[ban] = float("-inf")

    def apply(self, logits: torch.Tensor, logit_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` with table rows ``rows`` added to rows ``logit_rows`` (the logits' dtype kept)."""
        out = logits.clone()
        out[logit_rows] = (logits[logit_rows].float() + self.bias[rows]).to(logits.dtype)
        return out


def hold_back(logits: torch.Tensor, logit_rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``logits`` with token ``token_ids[i]`` of row ``logit_rows[i]`` at -inf (min_tokens: EOS not yet)."""
    out = logits.clone()
    out[logit_rows, token_ids] = float("-inf")
    return out
