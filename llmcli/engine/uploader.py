"""Uploader: a step's host values packed into one pinned buffer per dtype and copied to the device at once."""
from __future__ import annotations

import numpy as np
import torch

from llmcli.engine.pinned import StagingRing

_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


ALIGN = 16  # elements: every part starts 64- or 128-byte aligned in the packed buffer


class Uploader:
    """Packs lists of numbers into one pinned host buffer per call and copies it to the device at once.

    Each part starts at a multiple of ``ALIGN`` elements: Triton and Inductor compile a separate kernel
    for a pointer that is not 16-byte aligned, so parts at arbitrary offsets would trigger fresh
    compilations whenever a step's sizes change the alignment. On CUDA the host buffers come from a ring
    reused step after step (``StagingRing``: handed out again only once the copy that read them has run),
    so the host neither allocates pinned memory nor waits for the device here.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ring = StagingRing() if device.type == "cuda" else None

    def upload(self, dtype: torch.dtype, *parts: list) -> list[torch.Tensor]:
        starts, total = [], 0
        for part in parts:
            starts.append(total)
            total += -(-len(part) // ALIGN) * ALIGN
        total = max(total, 1)
        if self.ring is None:
            values = np.zeros(total, dtype=_NP[dtype])
        else:
            host = self.ring.take(total * dtype.itemsize).view(dtype)
            values = host.numpy()  # the gaps between parts keep old values: nothing reads them
        for start, part in zip(starts, parts):
            values[start:start + len(part)] = part
        if self.ring is None:
            packed = torch.from_numpy(values)
        else:
            packed = host.to(self.device, non_blocking=True)
            self.ring.copied()
        return [packed[start:start + len(part)] for start, part in zip(starts, parts)]
