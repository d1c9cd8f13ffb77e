"""Worker threads' big buffers (`scratch`) are made, filled and freed without holding the GIL
against the loop: `bytearray(64 MiB)` held it 63 ms on the VM."""

from __future__ import annotations

import os
import threading
import time

import pytest

from wcd.arenas.base import SCRATCH_MMAP_BYTES, pread_into, scratch


def _waited_ns() -> int:
    """ns this thread spent runnable but off a CPU (other people's load on a shared machine)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1])


def test_small_scratch_is_plain_memory_and_zeroed() -> None:
    small, big = scratch(4096), scratch(SCRATCH_MMAP_BYTES)
    assert len(small) == 4096 and len(big) == SCRATCH_MMAP_BYTES
    assert not any(small) and big[:64] == bytes(64) and big[-64:] == bytes(64)
    assert type(big.obj).__name__ == "mmap" and isinstance(small.obj, bytearray)


@pytest.mark.slow  # a timing test: the other suites of a loaded machine made it wait 30 ms once
def test_big_scratch_buffers_do_not_hold_the_gil_against_other_threads() -> None:
    stop = threading.Event()
    worst = 0.0

    def churn() -> None:
        zero = os.open("/dev/zero", os.O_RDONLY)
        try:
            while not stop.is_set():
                buf = scratch(64 << 20)
                pread_into(zero, buf, 0)  # every page faulted in, as a digest's window is
                del buf
        finally:
            os.close(zero)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            waited, t = _waited_ns(), time.perf_counter()
            time.sleep(0.0002)
            worst = max(worst, time.perf_counter() - t - (_waited_ns() - waited) / 1e9)
    finally:
        stop.set()
        worker.join()
    assert worst < 0.02, f"a thread waited {worst * 1000:.0f} ms for the GIL while 64 MiB buffers came and went"
