"""The sampler on every path it has, over batch sizes that arrive mid-run (GPU check; CPU runs it eagerly).

Run 12 (2026-12-01) hit an Inductor code-generation error in the compiled top-k/top-p path once a new batch
size came along; this sweeps sizes and dtypes, with and without a token mask, and checks the draws are legal.
"""
from __future__ import annotations

import sys

import torch

from llmcli.layers.sampler import Sampler, sample
from llmcli.layers.token_mask import apply_token_bitmask

dev = "cuda" if torch.cuda.is_available() else "cpu"
V = 151936 if dev == "cuda" else 1000
sampler = Sampler()
gen = torch.Generator(device=dev).manual_seed(0)
bad = 0
for dtype in (torch.bfloat16, torch.float32):
    for B in (1, 2, 3, 5, 17, 64, 200, 256, 7):
        for filters in (False, True):
            for masked in (False, True):
                logits = (torch.randn(B, V, device=dev, generator=gen) * 3).to(dtype)
                temps = torch.rand(B, device=dev, generator=gen) + 0.3
                temps[0] = 0.0
                top_ks = torch.full((B,), 20, device=dev, dtype=torch.int64)
                top_ps = torch.full((B,), 0.95, device=dev)
                min_ps = torch.zeros(B, device=dev)
                seeds = torch.arange(B, device=dev, dtype=torch.int64)
                steps = torch.full((B,), 3, device=dev, dtype=torch.int64)
                allowed = torch.ones(B, V, dtype=torch.bool, device=dev)
                if masked:
                    words = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), device=dev, generator=gen,
                                          dtype=torch.int64).to(torch.int32)
                    logits = apply_token_bitmask(logits, words)
                    allowed = torch.isfinite(logits)
                try:
                    tokens = sampler(logits, temps, top_ks, top_ps, min_ps, seeds, steps, use_filters=filters)
                    legal = bool(allowed[torch.arange(B, device=dev), tokens].all())
                    top = logits[0].float()
                    greedy_ok = bool(top[tokens[0]] == top.max())  # any of tied maxima is a right answer
                    rows = torch.arange(B, device=dev)
                    chosen = logits.float()[rows, tokens]
                    in_top_k = not filters or bool(((logits.float() > chosen[:, None]).sum(-1) < 20).all())
                    # the torch path (the reference on CPU): the same seeds and steps draw the same tokens on
                    # CUDA too, but for a float32 near-tie now and then
                    ref = sample(logits, temps, top_ks, top_ps, min_ps, seeds, steps, filters)
                    differ = int((ref != tokens).sum())
                    ok = legal and greedy_ok and in_top_k and differ <= max(1, B // 50)
                    if not ok:
                        print(f"FAIL dtype={dtype} B={B} filters={filters} masked={masked}: "
                              f"{'illegal token' if not legal else 'greedy row not at the maximum' if not greedy_ok else 'outside the top 20' if not in_top_k else f'{differ} rows differ from the torch path'}")
                except Exception as exc:  # noqa: BLE001 - report every failing case
                    ok = False
                    print(f"FAIL dtype={dtype} B={B} filters={filters} masked={masked}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200]}")
                bad += not ok
print(f"sampler sweep on {dev}: {'all cases legal' if not bad else f'{bad} failing case(s)'}")
sys.exit(1 if bad else 0)
