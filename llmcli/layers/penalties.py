"""Repetition, presence and frequency penalties on the device, from per-request token counts kept there.

Each penalised request owns one row of two [rows, vocab] tables: ``seen`` marks its
prompt tokens, ``counts`` counts its generated tokens. The step adds the newest
generated token of each row (on the device, so an in-flight token needs no host
round trip) and then rewrites that row's logits:

* repetition (HF / vLLM): a logit of a token in the prompt or the output is divided by
  the penalty when positive, multiplied by it when negative;
* frequency and presence (OpenAI): ``logit -= frequency * count + presence * (count > 0)``
  over generated tokens only.
"""
from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised float32 copy of ``logits`` [P, V]; ``seen`` [P, V] bool (prompt), ``counts`` [P, V] (output)."""
    logits = logits.float()
    generated = counts > 0
    rep = repetition[:, None]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen | generated, scaled, logits)
    return logits - frequency[:, None] * counts.float() - presence[:, None] * generated.float()


def grow_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """``table`` [R, V], with zero rows added when it holds fewer than ``rows`` (at least doubled: a batch
    that grows one request at a time copies its tables a few times, not once per request)."""
    have = table.shape[0]
    if rows <= have:
        return table
    return torch.cat([table, table.new_zeros(max(rows, 2 * have, 8) - have, table.shape[1])])


class PenaltyTables:
    """The device tables, grown on demand (a request without penalties never touches them)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)

    @property
    def capacity(self) -> int:
        return self.seen.shape[0]

    def reserve(self, rows: int) -> None:
        self.seen, self.counts = grow_rows(self.seen, rows), grow_rows(self.counts, rows)

    def start(self, rows: torch.Tensor, prompt_rows: torch.Tensor, prompt_ids: torch.Tensor) -> None:
        """Rows taken by new requests: clear them and mark each one's prompt tokens."""
        self.seen[rows] = False
        self.counts[rows] = 0
        self.seen[prompt_rows, prompt_ids] = True

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one generated token per entry (a row may appear several times)."""
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.counts.index_put_((rows, token_ids), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, logit_rows: torch.Tensor, rows: torch.Tensor, repetition: torch.Tensor,
              presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` with rows ``logit_rows`` penalised by table rows ``rows``.

        The maths runs in float32; the result keeps the logits' dtype, so the sampler sees the kernels it
        compiled at start-up."""
        out = logits.clone()
        out[logit_rows] = apply_penalties(logits[logit_rows], self.seen[rows], self.counts[rows], repetition,
                                          presence, frequency).to(logits.dtype)
        return out
