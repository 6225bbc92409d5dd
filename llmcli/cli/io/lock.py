"""One writer per OUT: advisory locks, held for the whole run, on a sidecar file that names its holder and on OUT.

The first lock lives on ``OUT.llmcli-lock`` so that a run refused for bad
input never creates OUT, and so that the holder's pid can be read by the run
that is turned away. The file is removed when the run ends; a killed run
leaves it behind, but the kernel drops its lock, so the next run takes it over.
The lock file is opened without following links (another user may plant one
there to aim the pid at a file of yours): a link there is refused.

The second lock is on OUT's own inode, taken as soon as OUT exists: hard links
and bind mounts give one file many names, and each name has its own lock file,
but all of them reach the one inode. Nothing of it stays on disk, so a resume
takes it afresh.
"""
from __future__ import annotations

import contextlib
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
        self.out_fd: int | None = None  # OUT itself, flocked (see lock_output)
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
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                except OSError as exc:  # a full disk or quota: leave no empty lock file behind
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)
                    os.close(fd)
                    raise OutputLocked(f"cannot start OUT {self.output}: writing the lock file {self.path} "
                                       f"failed ({exc.strerror or exc}); free space in OUT's folder") from None
            self.fd = fd
            if mode is not None:
                try:
                    self.lock_output()
                except OutputLocked:
                    self.release()
                    raise
            return self

    def lock_output(self) -> None:
        """Lock OUT's inode (once it exists), so another name of the same file (a hard link, a bind mount)
        cannot be a second run's OUT; called again once the run has created OUT."""
        if self.fd is None or self.out_fd is not None:
            return  # no lock taken (a device, no locks on this filesystem), or OUT's is held already
        try:
            # Write access: NFS emulates flock with POSIX locks, and an exclusive one needs it.
            fd = os.open(self.output, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError:
            try:
                fd = os.open(self.output, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return  # the output checks say what is wrong with OUT
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputLocked(f"OUT {self.output} is being written by another llmcli process under another name "
                               "of the same file (a hard link or a bind mount); wait for it to finish, or stop it"
                               ) from None
        except OSError:
            os.close(fd)
            return  # the lock file's lock is what this filesystem offers
        self.out_fd = fd

    def _open(self) -> tuple[int, bool]:
        """The lock file, created if need be; read-only when another user's run left it (flock needs no write)."""
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | flags, 0o644), True
        except PermissionError:
            try:
                return os.open(self.path, os.O_RDONLY | flags), False
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._link() from None
            error = "Permission denied"
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link() from None
            error = exc.strerror or str(exc)
        raise OutputLocked(f"cannot create the lock file {self.path} next to OUT ({error}); "
                           "llmcli needs to write in OUT's folder")

    def _link(self) -> OutputLocked:
        return OutputLocked(f"the lock file {self.path} is a symbolic link, which llmcli does not write through "
                            "(someone may have aimed it at another file); remove it and run again")

    def release(self) -> None:
        if self.out_fd is not None:
            os.close(self.out_fd)
            self.out_fd = None
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
