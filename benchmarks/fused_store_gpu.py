"""The q/k norm + rotary kernel with the KV-cache store fused in, against the two kernels it replaced (issue #13).

Per forward (every layer, each with its own cache views of one pool, as the model runner lays them out):
(a) ``qk_norm_rotary`` then ``store_kv``, two launches per layer, and (b) ``qk_norm_rotary_store``, one.
Decode batches (M <= 256) are timed as one CUDA graph of all the layers' calls, replayed (launch gaps count as
in the decode graph); prefill sizes as eager launches. Every case first checks that (b) gives the same q/k and
the same pool as (a), bit for bit. Last: a results table (µs per forward, saved µs, speed-up).

    python benchmarks/fused_store_gpu.py              # on CUDA, well under a minute
    python benchmarks/fused_store_gpu.py --device cpu # smoke test: Triton's interpreter, tiny sizes
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.kernel_device import use_kernel_device  # noqa: E402

MODELS = {"0.6B": (16, 8, 128, 28), "8B": (32, 8, 128, 36)}  # q heads, kv heads, head_dim, layers
TINY = {"tiny": (4, 2, 16, 2)}
M_GPU = (1, 16, 64, 256, 2048, 18240)
M_CPU = (1, 5)
BLOCK_SIZE = 16
EPS = 1e-6


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--m", default=None, help="comma-separated token counts (default: %s)" % (M_GPU,))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    use_kernel_device(args.device)
    import triton.testing

    from llmcli.kernels import triton_elementwise as te
    from llmcli.kernels.triton_store import store_kv
    from llmcli.layers.rotary import RotaryEmbedding

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float16
    models = MODELS if cuda else TINY
    ms = tuple(int(v) for v in args.m.split(",")) if args.m else (M_GPU if cuda else M_CPU)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def time_us(fn) -> float:
        if cuda:
            return 1000 * triton.testing.do_bench(fn, warmup=10, rep=50)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    rows = []
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'cpu'}, dtype {dtype}")
    for model, (hq, hk, d, layers) in models.items():
        rotary = RotaryEmbedding(d, 40960, 1_000_000.0).to(device)
        qw, kw = (1 + 0.1 * torch.randn(d, dtype=dtype, device=device) for _ in range(2))
        for m in ms:
            qkv = torch.randn(m, (hq + 2 * hk) * d, dtype=dtype, device=device)
            q, k, v = (t.view(m, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
            positions = torch.randint(0, 40960, (m,), device=device)
            num_blocks = max(64, 2 * -(-m // BLOCK_SIZE))
            pool = torch.zeros(2, layers, num_blocks, BLOCK_SIZE, hk, d, dtype=dtype, device=device)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:m]
            slots[m - 1 :: 7] = -1

            def separate():
                outs = []
                for layer in range(layers):
                    qo, ko = te.qk_norm_rotary(q, k, positions, qw, kw, EPS, rotary.cos, rotary.sin)
                    store_kv(ko, v, pool[0, layer], pool[1, layer], slots)
                    outs.append((qo, ko))
                return outs

            def fused():
                return [te.qk_norm_rotary_store(q, k, v, positions, qw, kw, EPS, rotary.cos, rotary.sin,
                                                pool[0, layer], pool[1, layer], slots) for layer in range(layers)]

            ref_out = separate()
            ref_pool = pool.clone()
            pool.zero_()
            out = fused()
            sync()
            same = torch.equal(pool, ref_pool) and all(torch.equal(a, b) for x, y in zip(out, ref_out)
                                                         for a, b in zip(x, y))
            times = []
            for fn in (separate, fused):
                if cuda and m <= 256:  # a decode batch: the way the decode graph launches them
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    times.append(time_us(graph.replay))
                    del graph
                else:
                    times.append(time_us(fn))
            rows.append((model, m, layers, *times, same))
            print(f"{model:>5} M={m:<6} separate {times[0]:9.1f} us  fused {times[1]:9.1f} us  same bits {same}",
                  flush=True)
            del qkv, q, k, v, pool, ref_pool, out, ref_out
            if cuda:
                torch.cuda.empty_cache()

    print(f"\n{'model':>5} {'M':>6} {'layers':>6} {'separate us':>12} {'fused us':>9} {'saved us':>9} {'speedup':>7} "
          f"{'same bits':>9}")
    for model, m, layers, sep, fus, same in rows:
        print(f"{model:>5} {m:>6} {layers:>6} {sep:12.1f} {fus:9.1f} {sep - fus:9.1f} {sep / fus:7.2f} {str(same):>9}")
    if not all(r[-1] for r in rows):
        sys.exit("the fused kernel differs from qk_norm_rotary + store_kv")


if __name__ == "__main__":
    main()
