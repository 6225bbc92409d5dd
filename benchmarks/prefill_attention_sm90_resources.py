"""Compile the prefill attention kernel for sm_90 (H100/H200) on any machine and print its resources.

No GPU needed: Triton's own ptxas builds the cubin and cuobjdump reads registers per thread, stack
(register spills) and the shared memory Triton asked for, per tile shape, for the plain and the paged
variant. Pointers and strides get the divisibility-16 hints the real launch gets (without them Triton
would not vectorise the loads and the figures would mislead). One CTA of 8 warps per SM is the most
that fits once a thread needs more than 128 registers; shared memory above 227 KiB does not launch.

    python benchmarks/prefill_attention_sm90_resources.py [--group 2] [--tiles 128,32,8,4,128 64,64,4,3,,1 ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmcli.kernels import triton_prefill

INT_PTRS = ("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr")


def resources(tiles: triton_prefill.Tiles, group: int, paged: bool, head_dim: int = 128) -> str:
    kern = triton_prefill._prefill_kernel
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": 256 if paged else 1, "BLOCK_M": tiles.block_m,
              "BLOCK_N": tiles.block_n, "PAGED": paged, "QPT": tiles.block_m // group,
              "ONE_LOOP": tiles.one_loop}
    sig = {}
    for name in kern.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in INT_PTRS else "*bf16"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    hints = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if (n.endswith("_ptr") or n.startswith("stride_")) and n != "stride_bt" and n not in consts}
    compiled = triton.compile(ASTSource(kern, sig, consts, attrs=hints), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages,
                                       "maxnreg": tiles.maxnreg})
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        dump = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = next((line.split("REG:")[1] for line in dump.splitlines() if "REG:" in line), "?")
    regs, stack = usage.split()[0], usage.split()[1].split(":")[1]
    return f"regs {regs:>4} spill-stack {stack:>4} B  smem {compiled.metadata.shared / 1024:6.1f} KiB"


def parse_tiles(text: str) -> triton_prefill.Tiles:
    """``BLOCK_M,BLOCK_N,warps,stages[,maxnreg[,one_loop]]``; an empty maxnreg means none."""
    f = text.split(",")
    return triton_prefill.Tiles(*map(int, f[:4]), int(f[4]) if len(f) > 4 and f[4] else None,
                                len(f) > 5 and f[5] not in ("", "0"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", type=int, default=2, help="q heads per KV head (0.6B: 2, 8B: 4)")
    ap.add_argument("--tiles", nargs="*", default=None, help="BLOCK_M,BLOCK_N,warps,stages[,maxnreg[,one_loop]] ...")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    shapes = ([parse_tiles(t) for t in args.tiles] if args.tiles else [triton_prefill.LARGE, triton_prefill.SMALL])
    for tiles in shapes:
        for paged in (False, True):
            t = f"{tiles.block_m}x{tiles.block_n}/w{tiles.num_warps}/s{tiles.num_stages}"
            t += (f"/r{tiles.maxnreg}" if tiles.maxnreg else "") + ("/1loop" if tiles.one_loop else "")
            print(f"group {args.group} {t:<19} {'paged' if paged else 'plain':<5}  {resources(tiles, args.group, paged)}")


if __name__ == "__main__":
    main()
