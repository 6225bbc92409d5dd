"""Reading the SASS of kernels built for Hopper without a GPU (``sm90_build.build_for_sm90``): a kernel's K loop,
and the writes to registers that a warpgroup MMA still in flight reads.

Triton 3.6 (the GPU machine's) pipelines MMAs whose left operand is a register across K iterations and waits only
for the oldest of them, so the next iteration's instructions may reuse registers that the newer ones have not read
yet (triton-lang/triton#9433): undefined behaviour by the PTX manual. ``triton_moe.settled`` is llmcli's way out;
``unwaited_operand_writes`` finds such writes in the SASS of whichever Triton built it (later Triton releases wait
differently, so on those the check passes with or without ``settled``).
"""
from __future__ import annotations

import re


def _written(line: str) -> set[int]:
    """The R registers a SASS instruction writes (its first operand, widened by the access size)."""
    body = re.sub(r"^@!?P\w+\s+", "", line.split("\t")[-1].strip())
    m = re.match(r"([A-Z0-9_.]+)\s+R(\d+)\b", body)
    if not m or re.match(r"(ST|RED|ATOM|LDGSTS|HGMMA|BRA|BAR|WARPGROUP|DEPBAR)", m.group(1)):
        return set()
    op, first = m.group(1), int(m.group(2))
    width = 4 if ".128" in op or op.startswith("LDSM") and op.endswith(".4") else \
        2 if ".64" in op or op.startswith(("CS2R", "IMAD.WIDE")) or op.startswith("LDSM") and op.endswith(".2") else 1
    return set(range(first, first + width))


def unwaited_operand_writes(loop: list[str]) -> list[str]:
    """Instructions of a K loop (run twice, so the next iteration meets the last one's MMAs) that write a register
    holding the left operand of a warpgroup MMA not yet waited for (``WARPGROUP.DEPBAR.LE gsb0, N`` leaves the
    newest N in flight): undefined behaviour by the PTX manual; the likely cause of the 64 x 128 x 64 tile's wrong
    sums on an H200 (benchmarks/RESULTS.md, T2b)."""
    pending: list[set[int]] = []
    found = []
    for lap in range(2):
        for line in loop:
            mma = re.search(r"HGMMA\S*\s+R\d+,\s*R(\d+),", line)
            if mma:
                pending.append(set(range(int(mma.group(1)), int(mma.group(1)) + 4)))
                continue
            wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", line)
            if wait:
                keep = int(wait.group(1), 16)
                pending = pending[len(pending) - keep:] if keep else []
                continue
            if lap and any(_written(line) & regs for regs in pending):
                found.append(line.split("\t")[-1].strip())
    return found


def k_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (label to the branch back to it): the K loop."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.?L\w*\d+:$", line)}
    best = (0, 0)
    for i, line in enumerate(lines):
        back = re.search(r"BRA (\S+?);", line)
        if back and labels.get(back.group(1), i) < i and i - labels[back.group(1)] > best[1] - best[0]:
            best = (labels[back.group(1)], i)
    return lines[best[0] + 1:best[1] + 1]
