"""Comparing two engines' greedy outputs when bf16 near-ties make free-running decoding diverge.

Shared by tests/test_gpu_e2e.py and benchmarks/tp_gpu.py.
"""
from __future__ import annotations

import torch

TIE_TOL = 0.02  # a near-tie: two logits within this share of the largest |logit|
NOISE_SIGMAS = 4.0  # ... or within this many standard deviations of the reference's own bf16 noise on a gap


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


def gap_noise(step_logits: list[torch.Tensor], other_logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per position, the spread bf16 rounding puts on the gap between two logits, measured as the standard
    deviation of the difference between two implementations of the reference (transformers' sdpa and eager
    attention) on the same prefixes, times sqrt(2) for a gap of two such logits."""
    return [(a - b).std(dim=-1) * 2 ** 0.5 for a, b in zip(step_logits, other_logits)]


def is_near_tie(logits: torch.Tensor, ours: int, theirs: int, noise: float = 0.0) -> bool:
    gap = (logits[theirs] - logits[ours]).item()
    return gap <= max(TIE_TOL * logits.abs().max().item(), NOISE_SIGMAS * noise)


def count_near_ties(step_logits: list[torch.Tensor]) -> int:
    """Positions (rows of each [positions, vocab] tensor) whose two best logits are a near-tie."""
    total = 0
    for logits in step_logits:
        top = logits.topk(2, dim=-1).values
        total += int((top[:, 0] - top[:, 1] <= TIE_TOL * logits.abs().amax(-1)).sum())
    return total


def non_tie_mismatches(step_logits, ours, theirs, first_only: bool, noise=None) -> list[str]:
    """Positions where ``ours`` differs from ``theirs`` by more than a near-tie in the reference logits.

    ``noise`` (from ``gap_noise``), where given, widens a position's near-tie band to the reference's own
    measured bf16 noise there: a random-weight model with large logits (Llama-3.2-1B, GPU run of 2026-12-02)
    has gaps of 0.6-0.75 that two transformers attention implementations already disagree on.

    ``step_logits[i][j]`` are the reference's logits at position ``j`` of prompt ``i``, given its own
    prefix; with ``first_only`` each prompt is checked up to its first difference (after it the
    prefixes differ and the logits no longer apply).
    """
    bad = []
    for i, (logits, a, b) in enumerate(zip(step_logits, ours, theirs)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                if not is_near_tie(logits[j], x, y, 0.0 if noise is None else noise[i][j].item()):
                    bad.append(f"prompt {i} token {j}: {x} instead of {y}, logit gap "
                               f"{(logits[j][y] - logits[j][x]).item():.3f}")
                if first_only:
                    break
    return bad
