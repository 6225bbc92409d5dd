"""On CUDA: the MXFP4 fused MoE's speed at gpt-oss-20b's decode batches (32 experts top-4, hidden and
intermediate 2880) against the bf16 fused kernel over the same values, through each of its tile products
(kernels/triton_moe_mxfp4.py; ``frag`` over experts converted once beforehand, as a model holds them:
kernels/triton_moe_mxfp4_frag.py), and candidate tile sizes for ``scaled`` and ``frag``. ``-s`` prints the tables.

Run on the GPU machine: ``python -m pytest -q -s tests/test_gpu_moe_mxfp4_speed.py``.
"""
from __future__ import annotations

import pytest
import torch

from llmcli.kernels.moe_reference import route
from llmcli.kernels.triton_moe import MoeTuning
from llmcli.kernels.mxfp4_fragments import to_fragments
from llmcli.kernels.triton_moe_mxfp4 import KERNELS, fused_moe_mxfp4, mxfp4_kernel, mxfp4_tuning
from llmcli.kernels.triton_moe_mxfp4_frag import frag_tuning, fused_moe_mxfp4_frag
from test_triton_moe_mxfp4 import make_case, rel_err, values_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def timed(fn) -> float:
    """Seconds a call, averaged over 20 after 3 warm-up calls (compiles)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / 1e3


DECODE_BATCHES = (1, 16, 64, 256)


def decode_case(tokens: int):
    x, w13, w2, logits = make_case(tokens, 32, 4, 2880, 2880, torch.bfloat16, seed=tokens)
    weights, ids = route(logits, 4, normalize=True)
    return x, w13, w2, weights, ids


def test_mxfp4_is_faster_than_bf16_at_gpt_oss_20b_decode_batches():
    """A quarter of the bytes must show: at decode batches of 16 to 256 tokens (32 experts top-4, 2880 x 2880) the
    MXFP4 layer through the default kernel takes less time than the bf16 fused kernel over the same values. At one
    token both are bound by latency, not bytes (~50 us of bf16 reads, ~13 of MXFP4, against ~120-160 us taken), and
    which is faster changed between runs (benchmarks/RESULTS.md R3, S1): printed, not asserted.
    The printed table (-s) gives both MXFP4 kernels' times (``dequant``: the first kernel, ``scaled``:
    ``tl.dot_scaled``), their weight bandwidth (bytes of the experts touched / time) and bf16's time."""
    from llmcli.kernels.triton_moe import fused_moe

    default = mxfp4_kernel(torch.bfloat16, None, torch.device("cuda"))
    print(f"\n{'tokens':>6} {'experts':>7} | " + " | ".join(f"{k + ' us':>11} {'GB/s':>5}" for k in KERNELS)
          + f" | {'bf16 us':>8} | " + " ".join(f"{'bf16/' + k:>12}" for k in KERNELS) + f"  (default: {default})")
    slower = []
    for tokens in DECODE_BATCHES:
        x, w13, w2, weights, ids = decode_case(tokens)
        w13_16, w2_16 = values_of(*w13).to(torch.bfloat16), values_of(*w2).to(torch.bfloat16)
        f13, f2 = to_fragments(*w13, parts=2), to_fragments(*w2)
        runs = {k: (lambda k=k: fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel=k)) for k in KERNELS}
        runs["frag"] = lambda: fused_moe_mxfp4_frag(x, f13, f2, weights, ids)
        t = {k: timed(run) for k, run in runs.items()}
        t16 = timed(lambda: fused_moe(x, w13_16, w2_16, weights, ids))
        touched = len(ids.unique())
        gbs = {k: touched * 3 * 2880 * 2880 * 4.25 / 8 / t[k] / 1e9 for k in KERNELS}
        print(f"{tokens:6d} {touched:7d} | " + " | ".join(f"{t[k] * 1e6:11.1f} {gbs[k]:5.0f}" for k in KERNELS)
              + f" | {t16 * 1e6:8.1f} | " + " ".join(f"{t16 / t[k]:11.2f}x" for k in KERNELS))
        if tokens >= 16 and t[default] >= t16:
            slower.append(tokens)
        del w13_16, w2_16
    assert not slower, f"MXFP4 ({default}) not faster than bf16 at {slower} tokens"


def test_scaled_tile_candidates_agree_and_are_timed():
    """Tile sizes ``mxfp4_tuning`` did not pick for ``scaled``, each checked against the default's output at the
    decode batches and timed (-s prints the table): the data to retune from."""
    small = [MoeTuning(16, 32, 128, num_warps=2, num_stages=4), MoeTuning(16, 32, 64, num_warps=2, num_stages=4),
             MoeTuning(16, 64, 128, num_warps=4, num_stages=4), MoeTuning(16, 64, 128, num_warps=2),
             MoeTuning(16, 16, 128, num_warps=1, num_stages=4)]
    # 32-row tiles: at 256 tokens each expert holds ~32 rows, which a 64-row tile pads by half
    large = [MoeTuning(64, 128, 64, num_warps=8), MoeTuning(64, 64, 64, num_warps=4),
             MoeTuning(64, 64, 128, num_warps=4), MoeTuning(64, 128, 128, num_warps=8),
             MoeTuning(32, 64, 64, num_warps=4), MoeTuning(32, 64, 128, num_warps=4),
             MoeTuning(32, 128, 64, num_warps=4), MoeTuning(32, 32, 128, num_warps=2, num_stages=4)]
    print()
    for tokens in DECODE_BATCHES:
        x, w13, w2, weights, ids = decode_case(tokens)
        want = fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel="scaled")
        picked = mxfp4_tuning(tokens * 4, 32, "scaled")
        for tuning in small if picked.block_m == 16 else large:
            run = lambda: fused_moe_mxfp4(x, *w13, *w2, weights, ids, tuning, kernel="scaled")  # noqa: E731
            assert rel_err(run(), want) < 1e-2, tuning
            print(f"tokens {tokens:4d}: {tuning.block_m:3d} x {tuning.block_n:3d} x {tuning.block_k:3d}, "
                  f"{tuning.num_warps} warps, {tuning.num_stages} stages: {timed(run) * 1e6:7.1f} us"
                  + ("  (picked)" if tuning == picked else ""))


# deeper pipelines too: at decode batches frag streams ~2 TB/s of weights against a ~4.2 TB/s copy rate, so more
# bytes in flight a program may pay (16 x 128 x 64 holds ~10.5 KB a stage, 64 x 256 x 64 ~33 KB); and deeper K
# steps, which issue fewer instructions a weight (settled, offline sm_90 SASS: gate/up 3.75 at 16 x 128 x 64, 3.16
# at 16 x 128 x 128, 2.88 at 16 x 64 x 256; down 4.6, 3.75, 3.1): issue, not bytes, may bound frag at decode
FRAG_CANDIDATES = [MoeTuning(16, 64, 256), MoeTuning(16, 64, 128), MoeTuning(16, 128, 64, num_warps=8),
                   MoeTuning(16, 128, 64, num_warps=8, num_stages=4), MoeTuning(16, 128, 64, num_warps=8, num_stages=6),
                   MoeTuning(16, 128, 128, num_warps=8, num_stages=4), MoeTuning(16, 128, 128, num_warps=8),
                   MoeTuning(16, 256, 64, num_warps=16), MoeTuning(16, 256, 128, num_warps=16), MoeTuning(32, 64, 256),
                   MoeTuning(32, 128, 64, num_warps=8), MoeTuning(32, 128, 64, num_warps=8, num_stages=5),
                   MoeTuning(64, 64, 128), MoeTuning(64, 128, 128, num_warps=8), MoeTuning(128, 64, 64),
                   MoeTuning(128, 64, 64, num_stages=5), MoeTuning(32, 256, 64, num_warps=16),
                   MoeTuning(64, 256, 64, num_warps=16), MoeTuning(64, 256, 64, num_warps=16, num_stages=4),
                   MoeTuning(64, 256, 64, num_warps=16, num_stages=5)]


# refused by check_frag_tuning for their wrong sums on an H200 before the kernels settled each K step's MMAs
# (triton_moe.settled): run here unchecked, to see whether settling made them right
REFUSED = [MoeTuning(64, 128, 64, num_warps=8), MoeTuning(128, 128, 64, num_warps=8)]


def test_frag_tile_candidates_agree_and_are_timed(monkeypatch):
    """``frag`` at decode batches and two prefill sizes: every candidate tile (those whose token tile is within
    2x of the rows an expert holds) checked against ``scaled``'s output and timed beside it (-s prints the table:
    the data to pick ``frag_tuning``'s tiles from and to decide its default). The picked tile also unsettled
    (``settle=False``: what settling costs, and whether unsettled MMAs still give wrong sums), and the tiles
    refused before settling, unchecked: their rows say ``refused``."""
    from llmcli.kernels import triton_moe_mxfp4_frag

    refused_ok = []
    checked = triton_moe_mxfp4_frag.check_frag_tuning
    monkeypatch.setattr(triton_moe_mxfp4_frag, "check_frag_tuning",
                        lambda tuning: None if tuning in REFUSED else checked(tuning))
    print()
    wrong = []
    for tokens in (1, 16, 64, 128, 256, 1024, 4096):  # 128: about the default workload's mean decode batch
        x, w13, w2, weights, ids = decode_case(tokens)
        f13, f2 = to_fragments(*w13, parts=2), to_fragments(*w2)
        want = fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel="scaled")
        scaled = timed(lambda: fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel="scaled"))
        picked = frag_tuning(tokens * 4, 32)
        per_expert = tokens * 4 / 32
        rows = [(t, True, "") for t in FRAG_CANDIDATES] + [(picked, False, "  (picked, unsettled)")] \
            + [(t, True, "  (refused)") for t in REFUSED]
        for tuning, settle, note in rows:
            if tuning != picked and not per_expert / 2 <= tuning.block_m <= max(16, 2 * per_expert):
                continue
            run = lambda: fused_moe_mxfp4_frag(x, f13, f2, weights, ids, tuning, settle=settle)  # noqa: E731
            err = rel_err(run(), want)
            if err >= 1e-3 and settle and tuning not in REFUSED:
                # right tiles agree with scaled within 2e-4; the refused 64 x 128 x 64 gave 0.0016 and more
                wrong.append((tokens, tuning, err))
            if err < 1e-3 and tuning in REFUSED:
                refused_ok.append((tokens, tuning))
            print(f"tokens {tokens:4d}: {tuning.block_m:3d} x {tuning.block_n:3d} x {tuning.block_k:3d}, "
                  f"{tuning.num_warps} warps, {tuning.num_stages} stages: {timed(run) * 1e6:7.1f} us "
                  f"(scaled {scaled * 1e6:7.1f}), error {err:.4f}"
                  + (note or ("  (picked)" if tuning == picked else "")))
    print("refused tiles right now:", refused_ok or "none")
    assert not wrong, wrong
