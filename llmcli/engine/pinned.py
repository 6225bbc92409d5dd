"""Pinned host buffers reused step after step, for the copies between the host and the device.

A fresh pinned tensor per copy goes through PyTorch's caching host allocator (a lock, an event query per
block in flight, an event record when it is freed): tens of microseconds a step at batch 256 for a few
hundred bytes. These rings hand out the same buffers again instead, each guarded by one reused CUDA event.
"""
from __future__ import annotations

import torch

SLOTS = 64  # more than the copies of two steps in flight (a step makes ~10): a slot is almost never still busy when reused


class StagingRing:
    """Pinned host buffers for host-to-device copies: ``take`` a buffer, fill it, issue the copies that read
    it, then ``copied()``; the buffer is handed out again only once those copies have run."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self._current = -1

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 host tensor of ``nbytes`` (its contents are left over from earlier use)."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # returns at once unless the device is more than a ring behind
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[i] = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        self._current = i
        return buf[:nbytes]

    def copied(self) -> None:
        """The copies reading the buffer ``take`` returned last are enqueued (on the current stream)."""
        i = self._current
        if self._events[i] is None:
            self._events[i] = torch.cuda.Event()
        self._events[i].record()


class ReadbackRing:
    """Pinned host buffers for a step's device-to-host token copy; a buffer is free again once the step's
    reader has taken its tokens (``release``). When the next one is still held, a fresh one is made."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event] = [torch.cuda.Event() for _ in range(slots)]
        self._held = [False] * slots
        self._next = 0

    def take(self, like: torch.Tensor) -> tuple[int, torch.Tensor, torch.cuda.Event]:
        """(slot, a pinned host tensor shaped and typed as ``like``, the slot's event); slot -1: not a ring buffer."""
        i = self._next
        if self._held[i]:
            return -1, torch.empty(like.shape, dtype=like.dtype, pin_memory=True), torch.cuda.Event()
        self._next = (i + 1) % len(self._bufs)
        buf = self._bufs[i]
        numel = like.numel()
        if buf is None or buf.dtype != like.dtype or buf.numel() < numel:
            buf = self._bufs[i] = torch.empty(max(numel, 512), dtype=like.dtype, pin_memory=True)
        self._held[i] = True
        return i, buf[:numel].view(like.shape), self._events[i]

    def release(self, slot: int) -> None:
        if slot >= 0:
            self._held[slot] = False
