"""One writer per OUT: an advisory lock, held for the whole run, on a sidecar file that names its holder.

The lock lives on ``OUT.llmcli-lock`` rather than on OUT itself so that a run
refused for bad input never creates OUT, and so that the holder's pid can be
read by the run that is turned away. The file is removed when the run ends; a
killed run leaves it behind, but the kernel drops its lock, so the next run
takes it over.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

LOCK_SUFFIX = ".llmcli-lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutputLocked(Exception):
    """Another process holds OUT's lock, or the lock file cannot be made; the message says which."""


def lock_path(output: str | Path) -> Path:
    out = Path(os.path.realpath(output))  # two links to one OUT share one lock
    return out.with_name(out.name + LOCK_SUFFIX)


def _holder(fd: int) -> str:
    """The pid the holder wrote (it writes right after locking: give it a moment)."""
    for _ in range(5):
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if text:
            return f"pid {text}"
        time.sleep(0.05)
    return "pid unknown"


class OutputLock:
    """Exclusive lock on OUT for this process; ``warning`` is set when the filesystem has no locks."""

    def __init__(self, output: str) -> None:
        self.output = output
        self.path = lock_path(output)
        self.fd: int | None = None
        self.warning: str | None = None

    def acquire(self) -> "OutputLock":
        try:
            mode = os.stat(self.output).st_mode
        except FileNotFoundError:
            mode = None
        except OSError:
            return self  # the output checks report what is wrong with OUT
        if mode is not None and not stat.S_ISREG(mode):
            return self  # a device or pipe (/dev/null, a FIFO) is not a file two runs could both fill
        if not self.path.parent.is_dir():
            return self  # the output checks say that OUT's folder does not exist
        while True:
            fd, writable = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise OutputLocked(f"OUT {self.output} is being written by another llmcli process ({holder}, "
                                   f"lock file {self.path}); wait for it to finish, or stop it") from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise OutputLocked(f"cannot lock {self.path}: {exc.strerror or exc}") from None
                self.warning = (f"warning: the filesystem of OUT {self.output} does not support locks "
                                f"({exc.strerror}); make sure no other llmcli writes OUT at the same time")
                return self
            # A holder that finishes unlinks the file: the inode locked must still be the one at the path.
            try:
                same = os.path.samestat(os.stat(self.path), os.fstat(fd))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if writable:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self.fd = fd
            return self

    def _open(self) -> tuple[int, bool]:
        """The lock file, created if need be; read-only when another user's run left it (flock needs no write)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), True
        except PermissionError:
            try:
                return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), False
            except OSError:
                pass
            error = "Permission denied"
        except OSError as exc:
            error = exc.strerror or str(exc)
        raise OutputLocked(f"cannot create the lock file {self.path} next to OUT ({error}); "
                           "llmcli needs to write in OUT's folder")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a waiting opener then sees a stale inode and retries
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
