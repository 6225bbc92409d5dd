"""The tensor-parallel control plane: one shared-memory segment plus two semaphores per worker.

Rank 0 writes each call (a command number, a method name and its arguments,
pickled) into the payload area of the segment and releases every worker's
``command`` semaphore. A worker acquires its ``command`` semaphore, copies the
payload out, and releases its ``ack`` semaphore; rank 0 writes the next payload
only when it has acquired every worker's ack for the previous one, so a payload
is never overwritten while someone still reads it.

Semaphores, not ``multiprocessing.Event``: an event's ``set`` waits until each
process sleeping in ``wait`` has woken, so a worker killed while it waited for
a call made rank 0's next ``set`` block forever, and the watchdog could only
end the process. Releasing a semaphore never waits for anyone.

Layout of the segment::

    [0, 64)                       header: command number (u64), payload length (u64)
    [64, 64 + world * 64 KiB)     one error slot per rank: length (u32) + UTF-8 text
    [..., + world * 128)          one heartbeat slot per rank: beat counter (u64), length (u32), what it is doing
    [..., + payload_bytes)        the payload

A worker that fails writes its traceback into its error slot before exiting,
so rank 0 can say why it died. A thread of each worker bumps its heartbeat
counter every fraction of a second, next to a few words on what the worker is
doing, so rank 0 can tell a silent rank (stopped, frozen) from a busy one. The segment's name carries the owner's pid and
a random token (``llmcli_tp_<pid>_<hex>``), so engines never share one.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import struct
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable

SHM_PREFIX = "llmcli_tp_"
HEADER_BYTES = 64
ERROR_SLOT_BYTES = 64 * 1024
DEFAULT_PAYLOAD_MIB = 32
_HEADER = struct.Struct("<QQ")
_ERR_LEN = struct.Struct("<I")
HEARTBEAT_SLOT_BYTES = 128
_BEAT = struct.Struct("<QI")


class PayloadTooLarge(RuntimeError):
    """A step plan does not fit the shared-memory payload area."""


def payload_bytes_from_env() -> int:
    """Payload area size: ``LLMCLI_TP_SHM_MIB`` MiB (default 32)."""
    from llmcli.config import env_number

    return int(env_number("LLMCLI_TP_SHM_MIB", DEFAULT_PAYLOAD_MIB)) << 20


@dataclass
class ChannelSpec:
    """What a worker needs to attach (picklable into a spawned process)."""

    name: str
    world_size: int
    payload_bytes: int
    commands: list[Any]  # multiprocessing.Semaphore per worker, index rank - 1: one token = one call to take
    acks: list[Any]  # one token = that worker has copied the last payload out


def unlink_own_segments() -> None:
    """Remove every control segment this process created (for a process about to end without clean-up)."""
    import glob

    for path in glob.glob(f"/dev/shm/{SHM_PREFIX}{os.getpid()}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
            resource_tracker.unregister("/" + os.path.basename(path), "shared_memory")


class ControlChannel:
    def __init__(self, shm: SharedMemory, spec: ChannelSpec, owner: bool) -> None:
        self.shm, self.spec, self.owner = shm, spec, owner
        self.heartbeat_offset = HEADER_BYTES + spec.world_size * ERROR_SLOT_BYTES
        self.payload_offset = self.heartbeat_offset + spec.world_size * HEARTBEAT_SLOT_BYTES
        self.command_number = 0
        self._closed = False

    # -- life cycle -------------------------------------------------------------
    @classmethod
    def create(cls, ctx: Any, world_size: int, payload_bytes: int | None = None) -> "ControlChannel":
        payload_bytes = payload_bytes or payload_bytes_from_env()
        meta = HEADER_BYTES + world_size * (ERROR_SLOT_BYTES + HEARTBEAT_SLOT_BYTES)
        name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        # SharedMemory registers the new segment with multiprocessing's resource tracker after creating it, and
        # starting the tracker then (pipes, a process) can fail and leave the segment behind: start it first.
        resource_tracker.ensure_running()
        shm = SharedMemory(name=name, create=True, size=meta + payload_bytes)
        try:
            shm.buf[:meta] = bytes(meta)
            workers = range(world_size - 1)
            # each ack starts with its token: nothing is outstanding yet
            spec = ChannelSpec(name, world_size, payload_bytes, [ctx.Semaphore(0) for _ in workers],
                               [ctx.Semaphore(1) for _ in workers])
            return cls(shm, spec, owner=True)
        except BaseException:
            # Not yet anyone's channel, so no clean-up path knows it: the segment must not outlive this call
            # (a descriptor limit makes the events fail, a Ctrl-C may land here).
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, spec: ChannelSpec) -> "ControlChannel":
        return cls(SharedMemory(name=spec.name), spec, owner=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.shm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with the process
                pass

    def unlink(self) -> None:
        """Remove the segment's name (idempotent; any process may call it)."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass

    # -- rank 0 -------------------------------------------------------------------
    def wait_acks(self, check: Callable[[], None], poll_s: float = 0.05) -> None:
        """Take every worker's ack of the previous payload; ``check`` raises if one died (the group is then over)."""
        for ack in self.spec.acks:
            while not ack.acquire(timeout=poll_s):
                check()

    def post(self, method: str, args: tuple, check: Callable[[], None]) -> int:
        """Broadcast ``method(*args)`` to every worker; returns the command number."""
        data = pickle.dumps((self.command_number + 1, method, args), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.spec.payload_bytes:
            raise PayloadTooLarge(
                f"the tensor-parallel control message for {method!r} is {len(data) / 2**20:.1f} MiB, more than "
                f"the {self.spec.payload_bytes / 2**20:.0f} MiB shared-memory area; set LLMCLI_TP_SHM_MIB higher "
                "or lower max_num_seqs / max_num_batched_tokens")
        self.wait_acks(check)
        self.command_number += 1
        off = self.payload_offset
        self.shm.buf[off:off + len(data)] = data
        _HEADER.pack_into(self.shm.buf, 0, self.command_number, len(data))
        for command in self.spec.commands:
            command.release()
        return self.command_number

    def read_error(self, rank: int) -> str:
        off = HEADER_BYTES + rank * ERROR_SLOT_BYTES
        (n,) = _ERR_LEN.unpack_from(self.shm.buf, off)
        n = min(n, ERROR_SLOT_BYTES - _ERR_LEN.size)
        return bytes(self.shm.buf[off + _ERR_LEN.size:off + _ERR_LEN.size + n]).decode("utf-8", "replace")

    # -- workers ------------------------------------------------------------------
    def wait_command(self, rank: int, timeout: float) -> bool:
        """Whether a call arrived within ``timeout`` (it must then be taken with ``take_command``)."""
        return self.spec.commands[rank - 1].acquire(timeout=timeout)

    def take_command(self, rank: int) -> tuple[int, str, tuple]:
        """Copy the current payload out, acknowledge it, and return ``(number, method, args)``."""
        number, n = _HEADER.unpack_from(self.shm.buf, 0)
        off = self.payload_offset
        data = bytes(self.shm.buf[off:off + n])
        self.spec.acks[rank - 1].release()
        got_number, method, args = pickle.loads(data)
        if got_number != number:
            raise RuntimeError(f"control-plane payload is torn (header says command {number}, payload {got_number})")
        return number, method, args

    def beat(self, rank: int, doing: str | None = None) -> None:
        """One heartbeat of ``rank`` (only its own thread writes its slot), optionally saying what it now does."""
        off = self.heartbeat_offset + rank * HEARTBEAT_SLOT_BYTES
        count, n = _BEAT.unpack_from(self.shm.buf, off)
        if doing is not None:
            raw = doing.encode("utf-8", "replace")[:HEARTBEAT_SLOT_BYTES - _BEAT.size]
            self.shm.buf[off + _BEAT.size:off + _BEAT.size + len(raw)] = raw
            n = len(raw)
        _BEAT.pack_into(self.shm.buf, off, count + 1, n)

    def read_beat(self, rank: int) -> tuple[int, str]:
        """``rank``'s heartbeat count (0: none yet) and what it last said it was doing."""
        off = self.heartbeat_offset + rank * HEARTBEAT_SLOT_BYTES
        count, n = _BEAT.unpack_from(self.shm.buf, off)
        n = min(n, HEARTBEAT_SLOT_BYTES - _BEAT.size)
        return count, bytes(self.shm.buf[off + _BEAT.size:off + _BEAT.size + n]).decode("utf-8", "replace")

    def write_error(self, rank: int, text: str) -> None:
        raw = text.encode("utf-8", "replace")
        room = ERROR_SLOT_BYTES - _ERR_LEN.size
        if len(raw) > room:  # keep the end of a traceback: that is where the error is
            raw = b"...\n" + raw[-(room - 4):]
        off = HEADER_BYTES + rank * ERROR_SLOT_BYTES
        self.shm.buf[off + _ERR_LEN.size:off + _ERR_LEN.size + len(raw)] = raw
        _ERR_LEN.pack_into(self.shm.buf, off, len(raw))
