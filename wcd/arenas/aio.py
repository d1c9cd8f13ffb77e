"""Linux native AIO (`io_setup`, `io_submit`, `io_getevents`, `io_destroy`) through `syscall(2)`,
for the O_DIRECT reads of cold files: a loader thread keeps several reads in flight, so the disk
stays busy while the thread waits its turn for the GIL, which a thread doing one blocking `preadv`
at a time cannot (the H200's 16 loader threads kept 10-13 reads in flight where fastsafetensors'
16 C++ threads keep 15-16). No library: libaio would be a system dependency for four syscalls
whose ABI has not changed since Linux 2.6, and io_uring needs memory barriers ctypes cannot give.

Only reads into memory that stays put until they complete (pinned staging), only through O_DIRECT
descriptors (a buffered AIO read is done synchronously inside `io_submit`)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from collections.abc import Sequence

# (io_setup, io_destroy, io_submit, io_getevents) per machine; elsewhere, no AIO (plain reads).
_NUMBERS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_PREAD = 0  # IOCB_CMD_PREAD


class _Iocb(ctypes.Structure):
    # linux/aio_abi.h, little-endian (aio_key before aio_rw_flags)
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_uint32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


_L = ctypes.c_long  # every argument: numbers, and addresses (0 for NULL)
_calls: tuple[tuple[int, int, int, int], object, object, object] | None = None


def _syscalls() -> tuple[tuple[int, int, int, int], object, object, object] | None:
    """The syscall numbers, `syscall` releasing the GIL (it may block), and one keeping it (a poll
    that returns at once); None where there is no AIO to call."""
    global _calls
    numbers = _NUMBERS.get(platform.machine())
    if _calls is None and numbers is not None and sys.byteorder == "little" and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        call = ctypes.CFUNCTYPE(_L, _L, _L, _L, _L, _L, _L, use_errno=True)(("syscall", libc))
        held = ctypes.PYFUNCTYPE(_L, _L, _L, _L, _L, _L, _L)(("syscall", ctypes.PyDLL(None)))
        _calls = (numbers, call, held, libc)
    return _calls


class Aio:
    """One AIO context with room for `depth` reads in flight. `submit` queues reads, `reap` returns
    the finished ones as (tag, bytes read); a read that failed comes back as its negative errno.
    Raises OSError where the kernel has no AIO for this process (ENOSYS: disabled, or a sandbox)
    or none left (EAGAIN: fs.aio-max-nr)."""

    def __init__(self, depth: int) -> None:
        calls = _syscalls()
        if calls is None:
            raise OSError(errno.ENOSYS, "no Linux AIO on this machine")
        (self._setup, self._destroy, self._submit, self._getevents), self._call, self._held, _ = calls
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        self._iocbs = (_Iocb * depth)()
        self._pointers = (ctypes.c_void_p * depth)()
        self._events = (_Event * depth)()
        self._free = list(range(depth))  # iocb slots not in flight
        self._syscall(self._setup, depth, ctypes.addressof(self._ctx))
        self.in_flight = 0

    def _syscall(self, number: int, *args: int) -> int:
        ret = int(self._call(number, *args, *(0,) * (5 - len(args))))  # type: ignore[operator]
        if ret < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return ret

    def submit(self, reads: Sequence[tuple[int, int, int, int, int]]) -> None:
        """Queue reads (tag, fd, address, nbytes, file offset), at most `depth` in flight in all."""
        if len(reads) > len(self._free):
            raise ValueError(f"{len(reads)} reads with room for {len(self._free)}")
        slots: list[int] = []
        for tag, fd, address, nbytes, offset in reads:
            slot = self._free.pop()
            cb = self._iocbs[slot]
            ctypes.memset(ctypes.addressof(cb), 0, ctypes.sizeof(cb))
            cb.data, cb.opcode, cb.fildes, cb.buf, cb.nbytes, cb.offset = tag, _PREAD, fd, address, nbytes, offset
            self._pointers[len(slots)] = ctypes.addressof(cb)
            slots.append(slot)
        done = 0
        try:
            while done < len(slots):  # io_submit may take part of them
                done += self._syscall(self._submit, self._ctx.value, len(slots) - done,
                                      ctypes.addressof(self._pointers) + done * ctypes.sizeof(ctypes.c_void_p))
        finally:
            self._free.extend(slots[done:])  # those never queued
            self.in_flight += done

    def reap(self, wait: bool = True) -> list[tuple[int, int]]:
        """The reads finished so far, at least one if `wait` and any are in flight."""
        if not self.in_flight:
            return []
        events = ctypes.addressof(self._events)
        # First without blocking, keeping the GIL; then, if none had finished, blocking without it.
        n = int(self._held(self._getevents, self._ctx.value, 0, self.depth, events, 0))  # type: ignore[operator]
        if n <= 0 and wait:
            while True:
                try:
                    n = self._syscall(self._getevents, self._ctx.value, 1, self.depth, events, 0)
                    break
                except InterruptedError:
                    continue
        done = []
        for ev in self._events[: max(n, 0)]:
            cb = ctypes.cast(ctypes.c_void_p(ev.obj), ctypes.POINTER(_Iocb)).contents
            self._free.append((ctypes.addressof(cb) - ctypes.addressof(self._iocbs)) // ctypes.sizeof(_Iocb))
            done.append((int(ev.data), int(ev.res)))
        self.in_flight -= len(done)
        return done

    def drain(self) -> None:
        """Wait for every read in flight (their buffers may then be reused or freed); results dropped."""
        while self.in_flight:
            self.reap()

    def close(self) -> None:
        """Destroy the context (the kernel waits for what is still in flight)."""
        if self._ctx.value:
            ctx, self._ctx.value = self._ctx.value, 0
            self._syscall(self._destroy, ctx)
