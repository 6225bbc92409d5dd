"""Top-k / top-p / min-p without a sort (llmcli.kernels.triton_sample_filter) against the sort-based reference.

The kept set must be the reference's exactly (ties with the k-th value kept; ties at the top-p boundary kept
together), on rows full of ties and near-ties, with k and p varied per row and unfiltered rows mixed in; a
seeded draw must be the reference path's token; draws over many seeds must follow the filtered softmax.
The kept sets are also checked against a float64 rule written out here on NumPy. Without CUDA the kernels run
under Triton's interpreter (set below, before any kernel module is imported), in float32.
"""
from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("triton_sample", "triton_sample_filter"):
        if f"llmcli.kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"llmcli.kernels.{_name}"])

from scipy.stats import chi2  # noqa: E402

from llmcli.kernels.sample_scale import inverse_temperatures  # noqa: E402
from llmcli.kernels.triton_sample_filter import WINDOW, thresholds  # noqa: E402
from llmcli.layers.sampler import filter_logits, sample, sample_one_pass, scale_logits  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def rule_kept(scaled: np.ndarray, k: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """The kept set by the documented rule, in float64 on NumPy, and each token's mass strictly above it."""
    s = scaled.astype(np.float64)
    kth = np.sort(s)[::-1][k - 1] if 0 < k < len(s) else -np.inf
    in_k = s >= kth
    e = np.where(in_k, np.exp(s - s.max()), 0.0)
    e /= e.sum()
    order = np.argsort(-s, kind="stable")
    values, weights = s[order], e[order]
    distinct, first = np.unique(-values, return_index=True)  # groups of equal values, largest first
    above_group = np.concatenate([[0.0], np.cumsum(np.add.reduceat(weights, first))[:-1]])
    above = np.empty_like(s)
    above[order] = above_group[np.searchsorted(distinct, -values)]
    kept = in_k & ((above < p) | (p >= 1))
    return kept, above


def tie_heavy_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits rounded to a coarse grid (many exact ties), plus rows with near-ties (1 ulp apart)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[::2] = (logits[::2] * 4).round() / 4  # exact ties everywhere
    top = logits[1::2].amax(-1, keepdim=True)
    near = torch.nextafter(top, torch.tensor(float("-inf")))  # 1 ulp below the max: a near-tie
    logits[1::2, : vocab // 50] = near
    return logits


def row_settings(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ks = torch.tensor([20, -1, 1, 5, WINDOW, WINDOW + 1, 300, -1, 50, 2])[torch.arange(rows) % 10]
    ps = torch.tensor([0.95, 0.9, 1.0, 0.5, 0.99, 1.0, 0.7, 1.0, 0.2, 0.999])[torch.arange(rows) % 10]
    temps = torch.rand(rows, generator=g) * 1.2 + 0.3
    return ks, ps, temps


@pytest.mark.parametrize("vocab,seed", [(1000, 0), (3001, 1), (40, 2)])
def test_kept_set_is_the_reference_kept_set(vocab, seed):
    """20 rows: exact ties, 1-ulp near-ties, k in and beyond the window, top-p alone (bisection), both, neither."""
    rows = 20
    logits = tie_heavy_rows(rows, vocab, seed)
    ks, ps, temps = row_settings(rows, seed)
    tau = thresholds(logits.to(DEVICE), inverse_temperatures(temps).to(DEVICE), ks.to(DEVICE), ps.to(DEVICE)).cpu()
    scaled = scale_logits(logits, temps)
    ours = scaled >= tau[:, None]
    ref = torch.isfinite(filter_logits(scaled, ks, ps))
    for r in range(rows):
        want, above = rule_kept(scaled[r].numpy(), int(ks[r]), float(ps[r]))
        assert np.array_equal(ref[r].numpy(), want), f"reference, row {r}"
        differ = np.flatnonzero(ours[r].numpy() != want)
        # a float32 mass within rounding of p may fall either side (the kernel sums in float32)
        assert (np.abs(above[differ] - float(ps[r])) < 1e-5).all(), \
            f"row {r} (k={int(ks[r])}, p={float(ps[r])}): {len(differ)} tokens differ, kept {int(ours[r].sum())}" \
            f" vs {int(want.sum())}"


@pytest.mark.slow
def test_kept_set_at_a_full_size_vocabulary():
    """151,936 logits: Qwen3's defaults (the window), top-p alone (bisection) and top-k 200 (count bisection)."""
    vocab = 151936
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16).float()
    ks, ps, temps = torch.tensor([20, -1, 200]), torch.tensor([0.95, 0.9, 1.0]), torch.tensor([0.6, 1.0, 0.7])
    tau = thresholds(logits.to(DEVICE), inverse_temperatures(temps).to(DEVICE), ks.to(DEVICE), ps.to(DEVICE)).cpu()
    scaled = scale_logits(logits, temps)
    ours = scaled >= tau[:, None]
    for r in range(3):
        want, above = rule_kept(scaled[r].numpy(), int(ks[r]), float(ps[r]))
        differ = np.flatnonzero(ours[r].numpy() != want)
        assert (np.abs(above[differ] - float(ps[r])) < 1e-5).all(), f"row {r}: {len(differ)} tokens differ"
    assert ours[2].sum() >= 200 and ours[1].sum() > 1000  # bf16 ties: at least k; top-p 0.9 of a wide row


def test_seeded_draw_is_the_reference_paths_token():
    """A mixed batch (greedy, unfiltered, top-k, top-p, both, min-p): the sort-free path draws exactly the token
    the sort-based reference path draws with the same seeds and steps."""
    rows, vocab = 30, 2500
    logits = tie_heavy_rows(rows, vocab, 9)
    ks, ps, temps = row_settings(rows, 9)
    temps[::7] = 0.0  # greedy rows
    ks[3::6], ps[3::6] = -1, 1.0  # unfiltered rows
    min_ps = torch.where(torch.arange(rows) % 4 == 0, 0.1, 0.0)
    seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(3))
    steps = torch.arange(rows) * 37
    args = [t.to(DEVICE) for t in (logits, temps, ks, ps, min_ps, seeds, steps)]
    ours = sample_one_pass(*args, True).cpu()
    ref = sample(logits, temps, ks, ps, min_ps, seeds, steps, True)
    assert torch.equal(ours, ref)
    kept = torch.isfinite(filter_logits(scale_logits(logits, temps), ks, ps))
    assert kept[torch.arange(rows), ours].all()


@pytest.mark.parametrize("top_k,top_p,min_p", [(10, 0.8, 0.0), (-1, 0.7, 0.0), (8, 1.0, 0.05)])
def test_draws_over_seeds_follow_the_filtered_softmax(top_k, top_p, min_p):
    """4,000 seeds on one row: a chi-square test against the softmax over the rule's kept set (fixed seeds, so
    deterministic), tokens outside it never drawn. The statistics run on the torch path (the interpreter is
    slow); the sort-free path must draw exactly its tokens for the first 150 seeds."""
    vocab, n, temp = 60, 4000, 0.8
    row = torch.linspace(-3.0, 3.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))]
    full = lambda v, dtype=torch.float32: torch.full((n,), v, dtype=dtype)  # noqa: E731
    args = [row.expand(n, vocab).contiguous(), full(temp), full(top_k, torch.int64), full(top_p), full(min_p),
            torch.arange(n) * 7919 + 11, full(4, torch.int64)]
    tokens = sample(*args, True)
    few = sample_one_pass(*[a[:150].to(DEVICE) for a in args], True).cpu()
    assert torch.equal(few, tokens[:150])
    scaled = (row * inverse_temperatures(torch.tensor([temp]))).numpy()
    kept, _ = rule_kept(scaled, top_k, top_p)
    if min_p > 0:
        kept &= scaled >= scaled.max() + np.log(min_p)
    want = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
    want /= want.sum()
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert counts[~kept].sum() == 0 and 1 < kept.sum() < vocab
    stat = ((counts[kept] - n * want[kept]) ** 2 / (n * want[kept])).sum()
    assert stat < chi2.ppf(0.999, kept.sum() - 1), (stat, int(kept.sum()))


def test_start_up_check_drops_a_threshold_kernel_that_keeps_too_little(monkeypatch):
    """A threshold at each row's maximum (every draw the argmax: inside the kept set, but wrong) must turn the
    sort-free path off at start-up."""
    from llmcli.kernels import triton_sample_filter
    from llmcli.layers.sampler import Sampler

    monkeypatch.setattr(triton_sample_filter, "thresholds", lambda logits, inv_t, *a: logits.float().amax(-1) * inv_t)
    bad = Sampler()
    reason = bad.check_one_pass(3000, DEVICE)
    assert reason is not None and "sort-based" in reason and not bad.one_pass
