"""MXFP4 experts in the ``frag`` layout (kernels/mxfp4_fragments.py) and its kernel
(kernels/triton_moe_mxfp4_frag.py): where each code and scale lands, checked against the layout as documented (not
against the converter's own arithmetic); the way back; the kernel's unpacking PTX, run here instruction by
instruction, giving each weight's bf16 in its register (the one part of the kernel the interpreter cannot run:
it runs an integer emulation instead); the kernel's cases the shared tests do not reach (two
warpgroups, scales above 2^1) against dequantize-then-matmul under the interpreter; gpt-oss's block converted
after loading; and the sm_90 build, whose K loop must feed the tensor cores from registers with no value moving
between threads. The shared kernel tests (every path, biases, the clamp, idle experts) run ``frag`` too:
tests/test_triton_moe_mxfp4.py.
"""
from __future__ import annotations

import re

import pytest
import torch

from test_triton_moe_mxfp4 import (DEVICE, ON_GPU, TOL, gpt_oss_blocks, checkpoint_experts, make_case,  # noqa: I001
                                   reference, rel_err)

from llmcli.kernels.moe_reference import route
from llmcli.kernels.mxfp4_fragments import fragment_codes, to_fragments
from llmcli.kernels.triton_moe import MoeTuning
from llmcli.kernels.triton_moe_mxfp4 import fused_moe_mxfp4
from llmcli.kernels.triton_moe_mxfp4_frag import check_frag_tuning, frag_tuning
from llmcli.layers.quantization.mxfp4 import mxfp4_values


def documented_word(nibble: int, p: int, h: int) -> int:
    """The module docstring's bit placement of code ``nibble`` (sign, exponent 2 bits, mantissa) in register ``p``,
    half ``h`` of its word: for p < 3 mantissa, exponent at bits 6-8 minus 3p and the sign at 15 minus 3p; for p = 3
    the exponent at 13-14, the mantissa at 11, the sign at 10."""
    sign, exponent, mantissa = nibble >> 3, (nibble >> 1) & 3, nibble & 1
    if p < 3:
        bits = (mantissa << (6 - 3 * p)) | (exponent << (7 - 3 * p)) | (sign << (15 - 3 * p))
    else:
        bits = (exponent << 13) | (mantissa << 11) | (sign << 10)
    return bits << (16 * h)


@pytest.mark.parametrize("row,k,nibble", [(0, 0, 0b1011), (9, 3, 0b0111), (37, 58, 0b1110), (70, 100, 0b0001),
                                          (127, 127, 0b1111), (64 + 16 + 8 + 5, 64 + 16 + 8 + 6 + 1, 0b0101)])
def test_a_code_lands_where_the_layout_says(row, k, nibble):
    """One code in a zero matrix of 128 x 128: only the word of thread 32w + 4g + c at step j of its sub-tile holds
    bits, in register 2J + (row is g + 8), half k % 2."""
    codes = torch.zeros(1, 128, 64, dtype=torch.uint8)
    codes[0, row, k // 2] = nibble << (4 * (k % 2))
    frag = to_fragments(codes, torch.full((1, 128, 4), 127, dtype=torch.uint8))
    assert frag.codes.shape == (1, 2, 2, 2048) and not frag.wide
    rr, kk = row % 64, k % 64
    w, r8, g = rr // 16, rr % 16 // 8, rr % 8
    j, big_j, c, h = kk // 16, kk % 16 // 8, kk % 8 // 2, kk % 2
    words = frag.codes[0, row // 64, k // 64].view(torch.int32).long() & 0xFFFFFFFF
    index = 4 * (32 * w + 4 * g + c) + j
    assert words[index].item() == documented_word(nibble, 2 * big_j + r8, h)
    assert int(words.count_nonzero()) == 1
    assert frag.codes[0, [t for t in range(2) if t != row // 64]].count_nonzero() == 0


def test_a_scale_lands_in_each_of_its_four_lanes():
    """Scale (row, group) sits at byte 4t + 2 * (group % 2) + (row is g + 8) of sub-tile group // 2, for the four
    threads c = 0..3 of its rows' lane group; everything else is the padding's 127 or the other scales."""
    scales = torch.full((1, 64, 4), 127, dtype=torch.uint8)
    scales[0, 45, 3] = 200  # w 2, g 5, row g + 8; second sub-tile, its second group
    frag = to_fragments(torch.zeros(1, 64, 64, dtype=torch.uint8), scales)
    sub = frag.scales[0, 0, 1]
    where = sorted((sub == 200).nonzero().flatten().tolist())
    assert where == [4 * (32 * 2 + 4 * 5 + c) + 2 * 1 + 1 for c in range(4)]
    assert frag.wide and bool((frag.scales[0, 0, 0] == 127).all())


@pytest.mark.parametrize("experts,rows,cols,parts", [(2, 128, 128, 1), (3, 192, 160, 2), (1, 70, 2880, 1),
                                                     (2, 2880, 1440, 2)])
def test_fragments_give_back_the_checkpoint_layout(experts, rows, cols, parts):
    """Padded rows (70, 96 a part, 1,440 a part) and inputs (160, 1,440) come back exactly."""
    g = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    frag = to_fragments(codes, scales, parts)
    assert frag.tiles_n == -(-rows // parts // 64) and frag.tiles_k == -(-cols // 64)
    back_codes, back_scales = fragment_codes(frag)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


@pytest.mark.parametrize("tuning", [MoeTuning(16, 128, 128, num_warps=8), MoeTuning(32, 64, 256),
                                    MoeTuning(16, 256, 64, num_warps=16)],
                         ids=["two-warpgroups", "k-off-the-step", "four-warpgroups"])
def test_frag_with_scales_above_two_and_other_tiles(tuning):
    """Scales up to 2^7 (``wide``: two multiplies); 128 or 256 rows on two or four warpgroups with a partial last
    row tile (gate/up's 160 rows: 3 tiles of 64; down's 192); a K step of four sub-tiles over a K of 192 and 160
    (one step, part of it past K)."""
    x, w13, w2, logits = make_case(11, 6, 2, 192, 160, torch.float32, seed=5, gate_up_scales=(124, 134))
    weights, ids = route(logits, 2, normalize=True)
    assert to_fragments(*w13, parts=2).wide and not to_fragments(*w2).wide
    got = fused_moe_mxfp4(x, *w13, *w2, weights, ids, tuning, kernel="frag")
    assert rel_err(got, reference(x, w13, w2, weights, ids)) < TOL[torch.float32]


def run_ptx(asm: str, args: dict[int, int]) -> dict[int, int]:
    """The unpacking PTX run line by line on 32-bit integers (the few instructions it uses; ``mul.bf16x2`` as
    two float32 products rounded to bf16, exact here): operand ``$n`` -> value, the outputs included."""
    import numpy as np

    def bf16_mul(a: int, b: int) -> int:
        out = 0
        for shift in (0, 16):
            x, y = (np.array([(v >> shift) & 0xFFFF], dtype=np.uint32) << 16 for v in (a, b))
            prod = (x.view(np.float32) * y.view(np.float32)).view(np.uint32)[0]
            rounded = (int(prod) + 0x7FFF + ((int(prod) >> 16) & 1)) >> 16  # round to nearest even
            out |= (rounded & 0xFFFF) << shift
        return out

    regs: dict[str, int] = {f"${n}": v for n, v in args.items()}

    def val(token: str) -> int:
        return int(token, 0) if token[0].isdigit() else regs[token]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        result = {"mov.b32": lambda: a[0], "and.b32": lambda: a[0] & a[1], "or.b32": lambda: a[0] | a[1],
                  "shl.b32": lambda: a[0] << a[1], "shr.b32": lambda: a[0] >> a[1],
                  "mul.bf16x2": lambda: bf16_mul(a[0], a[1])}[op]()
        regs[dst] = result & 0xFFFFFFFF
    return {n: regs[f"${n}"] for n in range(4)}


@pytest.mark.parametrize("wide", [False, True])
def test_the_unpacking_ptx_gives_each_weight_in_its_register(wide):
    """The kernel's PTX, run instruction by instruction here (no GPU runs it in CI), on every word of a random
    64 x 64 sub-tile: register p, half h of thread 32w + 4g + c's word j is the bf16 of the weight at row
    16w + g + 8 (p % 2), k = 16j + 8 (p // 2) + 2c + h, with the multipliers the kernel makes of the thread's scale
    bytes (2 * group + row-is-g+8; ``wide``: scales up to 2^7 and 2^(scale - 127))."""
    from llmcli.kernels.triton_moe_mxfp4_frag import _unpack_asm

    g = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 256, (1, 64, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 135 if wide else 129, (1, 64, 2), generator=g, dtype=torch.uint8)
    frag = to_fragments(codes, scales)
    assert frag.wide == wide
    values = mxfp4_values(codes, scales)[0].to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    words = frag.codes[0, 0, 0].view(torch.int32).long() & 0xFFFFFFFF
    asm = _unpack_asm(wide)
    for t in range(0, 128, 3):
        w, g_, c = t // 32, t % 32 // 4, t % 4
        sc = frag.scales[0, 0, 0, 4 * t:4 * t + 4].long()
        for j in range(4):
            mult = [((int(sc[2 * (j // 2) + r8]) + (0 if wide else 126)) << 7) * 0x10001 for r8 in (0, 1)]
            out = run_ptx(asm, {4: int(words[4 * t + j]), 5: mult[0], 6: mult[0], 7: mult[1], 8: mult[1]})
            for p in range(4):
                for h in range(2):
                    row, k = 16 * w + g_ + 8 * (p % 2), 16 * j + 8 * (p // 2) + 2 * c + h
                    assert (out[p] >> (16 * h)) & 0xFFFF == int(values[row, k]), (t, j, p, h)


def test_frag_refuses_tiles_it_cannot_run():
    x, w13, w2, logits = make_case(3, 4, 2, 64, 64, torch.float32)
    weights, ids = route(logits, 2, normalize=True)
    with pytest.raises(ValueError, match="frag tiles"):
        fused_moe_mxfp4(x, *w13, *w2, weights, ids, MoeTuning(16, 32, 64), kernel="frag")
    with pytest.raises(ValueError, match="block_k 64, 128 or 256"):
        fused_moe_mxfp4(x, *w13, *w2, weights, ids, MoeTuning(16, 64, 192), kernel="frag")
    with pytest.raises(ValueError, match="two warpgroups or more take at most 64 tokens"):  # wrong on an H200
        fused_moe_mxfp4(x, *w13, *w2, weights, ids, MoeTuning(128, 128, 64, num_warps=8), kernel="frag")
    with pytest.raises(ValueError, match="64 x 128 x 64 gave wrong sums"):  # wrong on an H200 too
        fused_moe_mxfp4(x, *w13, *w2, weights, ids, MoeTuning(64, 128, 64, num_warps=8), kernel="frag")


def test_frag_tuning_picks_the_measured_tiles_and_each_is_runnable():
    """gpt-oss-20b's 32 experts, top-4: the tiles the H200 table picked (benchmarks/RESULTS.md, 2026-12-05)."""
    picks = {tokens: frag_tuning(4 * tokens, 32) for tokens in (1, 16, 64, 256, 1024, 4096)}
    assert [(t.block_m, t.block_n, t.block_k, t.num_warps) for t in picks.values()] == \
        [(16, 64, 256, 4), (16, 128, 64, 8), (16, 128, 64, 8), (64, 256, 64, 16), (128, 64, 64, 4), (128, 64, 64, 4)]
    for tuning in picks.values():
        check_frag_tuning(tuning)


def test_gpt_oss_block_converted_after_loading_gives_the_same(monkeypatch):
    """``finish_mxfp4`` where ``frag`` is picked: the checkpoint-order tensors are gone, the fragments are
    parameters (the memory probe counts them), and the block gives what the dequantized block gives, through the
    kernel and through its reference path (decoded from the fragments)."""
    from llmcli.layers.moe_mxfp4 import finish_mxfp4

    state = checkpoint_experts(8, 64, 96, seed=11)
    packed, plain = gpt_oss_blocks(state, 64, 96, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    monkeypatch.delenv("LLMCLI_MXFP4_KERNEL", raising=False)
    assert finish_mxfp4(packed, torch.float32) == 0  # scaled's default: nothing converted
    monkeypatch.setenv("LLMCLI_MXFP4_KERNEL", "frag")
    assert finish_mxfp4(packed, torch.float32) == 1 and finish_mxfp4(packed, torch.float32) == 0
    names = {n for n, _ in packed.named_parameters()}
    assert "experts.gate_up_proj_blocks" not in names and "experts.down_proj_frag_codes" in names
    assert packed.experts.gate_up_proj_frag_codes.shape == (8, 2 * 2, 1, 2048)  # 96 rows a part: 2 tiles
    monkeypatch.setenv("LLMCLI_MOE", "reference")
    want = plain(x)
    assert rel_err(packed(x), want) < 1e-5
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    assert rel_err(packed(x), want) < TOL[torch.float32]


def test_two_ranks_of_fragments_sum_to_the_whole(monkeypatch):
    """Tensor parallelism over 2 ranks with an intermediate share of 96 (a padded row tile of gate and of up, a
    padded last sub-tile of down's inputs): converted after loading, the ranks' partial outputs sum to the whole
    16-bit block's."""
    from llmcli.layers.moe_mxfp4 import finish_mxfp4

    state = checkpoint_experts(8, 64, 192, seed=12)
    monkeypatch.setenv("LLMCLI_MOE", "triton")
    monkeypatch.setenv("LLMCLI_MXFP4_KERNEL", "frag")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    whole = gpt_oss_blocks(state, 64, 192, 8, 2)[1](x)
    parts = [gpt_oss_blocks(state, 64, 192, 8, 2, rank=r, world=2)[0] for r in (0, 1)]
    assert [finish_mxfp4(p, torch.float32) for p in parts] == [1, 1]
    f13, f2 = parts[0].experts.fragments
    assert (f13.rows, f13.tiles_n, f2.cols, f2.tiles_k) == (96, 2, 96, 2)
    assert rel_err(parts[0](x) + parts[1](x), whole) < TOL[torch.float32]


# -- sm_90 -------------------------------------------------------------------------------------------------------------
_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmcli.kernels import triton_moe_mxfp4_frag as m

PTRS = {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8",
        "pairs_ptr": "*i32", "experts_ptr": "*i32", "total_ptr": "*i32", "weights_ptr": "*fp32",
        "alpha": "fp32", "limit": "fp32"}
for pairs in (4, 1024, 16384):  # gpt-oss-20b's 32 experts top-4: decode at 1 and 256 tokens, prefill
    t = m.frag_tuning(pairs, 32)
    tiles = dict(BLOCK_M=t.block_m, WG=t.block_n // 64, BLOCK_K=t.block_k, GROUP_M=t.group_m, WIDE=False,
                 EMULATE=False, BIAS=True, SETTLE=True)
    for kernel, extra in ((m._frag_gate_up_kernel, dict(TOP_K=4, CLAMPED=True)), (m._frag_down_kernel, {})):
        constexprs = dict(tiles, **extra)
        sig = {n: "constexpr" if n in constexprs else PTRS.get(n, "i32") for n in kernel.arg_names}
        # as the JIT specializes on a GPU: 16-byte aligned pointers, strides divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in constexprs
                 and n not in ("num_pairs", "alpha", "limit", "tiles_n", "tiles_k")}
        built = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=t.num_warps,
                                                                               num_stages=t.num_stages))
        print("=== " + kernel.__name__ + " " + str(pairs))
        print(built.asm["sass"])
"""


@pytest.mark.slow
def test_frag_k_loop_feeds_the_tensor_cores_from_registers():
    """Built for an H100/H200 with Triton's own ptxas (no GPU), at the tiles gpt-oss-20b picks: every K loop runs
    warpgroup MMAs whose left operand is a register (the unpacked weights), moves nothing through shared memory but
    the asynchronous copies and their 16-byte reads (no store, no shuffle between threads, no byte gathers), and
    multiplies in bf16 pairs; and no instruction writes a register an MMA still in flight reads (with the
    installed Triton: run on the GPU machine too, whose Triton 3.6 is the one that needs ``settled``)."""
    from sass_loops import k_loop, unwaited_operand_writes
    from sm90_build import build_for_sm90

    builds = build_for_sm90(_COMPILE, timeout=900).split("=== ")[1:]
    assert len(builds) == 6
    for build in builds:
        name, sass = build.split("\n", 1)
        loop = k_loop(sass)
        mma = [line for line in loop if "HGMMA" in line]
        assert mma and all(re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", line) for line in mma), name
        moved = [line for line in loop if re.search(r"\b(STS|STSM|SHFL)\b", line)]
        assert not moved, (name, moved[:3])
        # a thread's codes come out of the pipeline's buffer as whole 16-byte runs; a layout that does not match
        # the MMA's is gathered there byte by byte instead (LDS.U8 / LDS.U16: seen with two row bits swapped)
        narrow = [line for line in loop if re.search(r"\bLDS\.(U8|S8|U16|S16)\b", line)]
        assert not narrow and any("LDS.128" in line for line in loop), (name, narrow[:3])
        assert any("HMUL2.BF16" in line for line in loop), name
        assert not unwaited_operand_writes(loop), (name, unwaited_operand_writes(loop)[:3])
