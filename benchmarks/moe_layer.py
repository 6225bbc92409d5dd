#!/usr/bin/env python
"""One MXFP4 MoE layer at gpt-oss-20b's shapes (32 experts, top-4, hidden and intermediate 2880; random codes and
scales), run a few times through one kernel and tile: the smallest program to hand to ``ncu`` (hardware counters:
bandwidth, occupancy, stall reasons) or ``compute-sanitizer`` (initcheck, racecheck) on the GPU machine, where a
pytest run would put thousands of other kernels in the report. Prints the relative error against ``scaled``.

    python benchmarks/moe_layer.py --tokens 256 --kernel frag
    compute-sanitizer --tool initcheck python benchmarks/moe_layer.py --tokens 256 --tile 64x128x64x8x3 --unchecked
    ncu --clock-control none -k regex:_frag --section SpeedOfLight python benchmarks/moe_layer.py --tokens 128

``--tile`` is block_m x block_n x block_k x warps x stages; ``--unchecked`` runs a frag tile that
``check_frag_tuning`` refuses (to find out why it is wrong); ``--unsettled`` lets frag's MMAs run on into the next
K step as Triton 3.6 pipelines them (``triton_moe.settled``: wrong by the PTX manual; for A/Bs only).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from llmcli.kernels import triton_moe_mxfp4_frag as frag  # noqa: E402
from llmcli.kernels.moe_reference import route  # noqa: E402
from llmcli.kernels.mxfp4_fragments import to_fragments  # noqa: E402
from llmcli.kernels.triton_moe import MoeTuning  # noqa: E402
from llmcli.kernels.triton_moe_mxfp4 import fused_moe_mxfp4  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 32, 4, 2880, 2880


def tile(spec: str) -> MoeTuning:
    m, n, k, warps, stages = (int(v) for v in spec.split("x"))
    return MoeTuning(block_m=m, block_n=n, block_k=k, num_warps=warps, num_stages=stages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--kernel", default="frag", choices=["scaled", "dequant", "frag"])
    p.add_argument("--tile", type=tile, default=None, help="block_m x block_n x block_k x warps x stages")
    p.add_argument("--unchecked", action="store_true", help="run a frag tile check_frag_tuning refuses")
    p.add_argument("--unsettled", action="store_true", help="frag without settling each K step's MMAs (A/Bs)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    g = torch.Generator().manual_seed(args.seed)

    def experts(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (EXPERTS, rows, cols // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 124, (EXPERTS, rows, cols // 32), generator=g, dtype=torch.uint8)
        return codes.cuda(), scales.cuda()

    x = torch.randn(args.tokens, HIDDEN, generator=g).cuda().to(torch.bfloat16)
    w13, w2 = experts(2 * INTER, HIDDEN), experts(HIDDEN, INTER)
    weights, ids = route(torch.randn(args.tokens, EXPERTS, generator=g).cuda(), TOP_K, normalize=True)
    want = fused_moe_mxfp4(x, *w13, *w2, weights, ids, kernel="scaled")
    if args.kernel == "frag":
        f13, f2 = to_fragments(*w13, parts=2), to_fragments(*w2)
        if args.unchecked:
            frag.check_frag_tuning = lambda tuning: None
        run = lambda: frag.fused_moe_mxfp4_frag(x, f13, f2, weights, ids, args.tile,  # noqa: E731
                                                settle=not args.unsettled)
    else:
        run = lambda: fused_moe_mxfp4(x, *w13, *w2, weights, ids, args.tile, kernel=args.kernel)  # noqa: E731
    for _ in range(args.reps):
        got = run()
    torch.cuda.synchronize()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    picked = args.tile or (frag.frag_tuning(args.tokens * TOP_K, EXPERTS) if args.kernel == "frag" else "its pick")
    print(f"{args.kernel} at {args.tokens} tokens, tiles {picked}: relative error against scaled {err:.5f}, "
          f"non-finite outputs {int((~torch.isfinite(got)).sum())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
