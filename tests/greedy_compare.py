"""Comparing two engines' greedy outputs when bf16 near-ties make free-running decoding diverge.

Shared by tests/test_gpu_e2e.py and benchmarks/tp_gpu.py.
"""
from __future__ import annotations

import torch

TIE_TOL = 0.02  # a near-tie: two logits within this share of the largest |logit|


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where the two outputs hold the same token (position by position)."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def teacher_forced_prompts(prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """Every prefix ``prompt + continuation[:j]``: one request each, whose one greedy token is compared."""
    return [p + c[:j] for p, c in zip(prompts, continuations) for j in range(len(c))]


def regroup(flat: list[int], n: int) -> list[list[int]]:
    """The one-token answers to ``teacher_forced_prompts`` back as one row of ``n`` per prompt."""
    return [flat[i:i + n] for i in range(0, len(flat), n)]


def is_near_tie(logits: torch.Tensor, ours: int, theirs: int) -> bool:
    return (logits[theirs] - logits[ours]).item() <= TIE_TOL * logits.abs().max().item()


def count_near_ties(step_logits: list[torch.Tensor]) -> int:
    """Positions (rows of each [positions, vocab] tensor) whose two best logits are a near-tie."""
    total = 0
    for logits in step_logits:
        top = logits.topk(2, dim=-1).values
        total += int((top[:, 0] - top[:, 1] <= TIE_TOL * logits.abs().amax(-1)).sum())
    return total


def non_tie_mismatches(step_logits, ours, theirs, first_only: bool) -> list[str]:
    """Positions where ``ours`` differs from ``theirs`` by more than a near-tie in the reference logits.

    ``step_logits[i][j]`` are the reference's logits at position ``j`` of prompt ``i``, given its own
    prefix; with ``first_only`` each prompt is checked up to its first difference (after it the
    prefixes differ and the logits no longer apply).
    """
    bad = []
    for i, (logits, a, b) in enumerate(zip(step_logits, ours, theirs)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                if not is_near_tie(logits[j], x, y):
                    bad.append(f"prompt {i} token {j}: {x} instead of {y}, logit gap "
                               f"{(logits[j][y] - logits[j][x]).item():.3f}")
                if first_only:
                    break
    return bad
