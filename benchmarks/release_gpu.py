"""Does an engine give its GPU memory back at shutdown? One model, one child process per MXFP4 kernel.

Each child builds the engine (dummy weights, CUDA graphs), generates a little, shuts it down and prints what stays
allocated while the engine is still referenced (as when a script makes its next engine before dropping the last),
starts a second engine then as tests/test_gpu_e2e.py does (torch attention, eager) and prints its memory probe's
figures, then what stays after dropping the first and collecting garbage; where more than ``--slack-gib`` stays,
the largest CUDA tensors still alive and what holds each (a few levels of referrers). Run on the GPU machine:

    python benchmarks/release_gpu.py --model configs/gpt-oss-20b --kernels scaled frag
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys


def _holders(obj, depth: int, seen: set[int]) -> list[str]:
    if depth == 0:
        return []
    out = []
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or type(ref).__name__ in ("frame", "list") and depth < 3:
            continue
        seen.add(id(ref))
        desc = type(ref).__name__
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj][:2]
            desc += f" key {keys}"
        out.append("  " * (3 - depth) + desc)
        out += _holders(ref, depth - 1, seen)
        if len(out) > 12:
            break
    return out


def child(model: str, slack_gib: float) -> None:
    import torch

    from llmcli import LLM, SamplingParams

    llm = LLM(model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=2048)
    llm.generate([[i + 1] * (8 + i) for i in range(8)], SamplingParams(temperature=0, max_tokens=16,
                                                                     ignore_eos=True))
    held = torch.cuda.memory_allocated() / 2**30
    llm.shutdown()
    referenced = torch.cuda.memory_allocated() / 2**30
    free, total = torch.cuda.mem_get_info()
    print(f"kernel {os.environ.get('LLMCLI_MXFP4_KERNEL', 'default')}: {held:.2f} GiB allocated while running, "
          f"{referenced:.2f} GiB after shutdown (engine still referenced; device in use {(total - free) / 2**30:.2f} "
          f"GiB)", flush=True)
    if referenced > slack_gib:
        largest_alive()
    second_engine(model)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() / 2**30
    print(f"  {left:.2f} GiB after dropping it and gc")
    if left > slack_gib:
        largest_alive()


def second_engine(model: str) -> None:
    """Start an engine as tests/test_gpu_e2e.py's second one (torch attention, eager) while the first is still
    referenced, and print what its memory probe measured (or why it found no room)."""
    from llmcli import LLM
    from llmcli.engine.kv_cache import KVCacheTooSmall

    try:
        llm = LLM(model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=2048,
                  attention_backend="torch", enforce_eager=True)
        report, failed = llm.engine.model_runner.memory_report, ""
    except KVCacheTooSmall as e:
        report, failed, llm = e.report, f" (no KV block: {e})", None
    gib = 2**30
    print(f"  second engine (torch, eager): budget {report.budget_bytes / gib:.2f} GiB, weights "
          f"{report.weights_bytes / gib:.2f}, activation peak {report.activation_peak_bytes / gib:.2f}, other "
          f"{report.other_bytes / gib:.2f}, KV blocks {report.num_blocks}{failed}", flush=True)
    if llm is not None:
        llm.shutdown()


def largest_alive() -> None:
    import torch

    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    alive.sort(key=lambda t: -t.untyped_storage().nbytes())  # a view's storage may be far larger than the view
    print(f"{len(alive)} CUDA tensors alive; the largest:")
    for t in alive[:4]:
        print(f"- {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB of storage "
              f"{type(t).__name__}")
        print("\n".join(_holders(t, 3, {id(alive)})))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/gpt-oss-20b")
    p.add_argument("--kernels", nargs="+", default=["scaled", "frag"])
    p.add_argument("--slack-gib", type=float, default=0.5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.slack_gib)
        return
    for kernel in args.kernels:
        env = dict(os.environ, LLMCLI_MXFP4_KERNEL=kernel)
        subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--slack-gib",
                        str(args.slack_gib)], env=env, timeout=300)


if __name__ == "__main__":
    main()
