"""Host arenas the daemon closed while another holder kept their memory: counted until the last
mapping, fd or reopened description is gone (`wcd.arenas.host.Released`), and not a moment longer."""

from __future__ import annotations

import mmap
import os
import time

import pytest

from wcd.arenas.host import RELEASED, HostArena, _inotify

SIZE = 1 << 20


def held_becomes(expected: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while RELEASED.held() != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_arena_closed_with_no_other_holder_counts_nothing() -> None:
    before = RELEASED.held()
    HostArena(SIZE, "alone").close()
    assert RELEASED.held() == before


def test_a_mapping_kept_after_close_counts_until_it_is_unmapped() -> None:
    before = RELEASED.held()
    arena = HostArena(SIZE, "kept")
    kept = mmap.mmap(arena.fd(), SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)  # as a reader maps it
    arena.close()
    assert RELEASED.held() == before + SIZE
    kept.close()
    assert held_becomes(before)


def test_a_description_reopened_through_proc_counts_too() -> None:
    """A holder may reopen the memfd (/proc/PID/fd/N) and close the fd it was sent: the memory is
    still held, and counted, until the reopened description goes."""
    before = RELEASED.held()
    arena = HostArena(SIZE, "reopened")
    reopened = os.open(f"/proc/self/fd/{arena.fd()}", os.O_RDONLY)
    arena.close()
    assert RELEASED.held() == before + SIZE
    os.close(reopened)
    assert held_becomes(before)


def test_lost_events_are_made_up_from_the_live_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the inotify queue's length events are dropped (IN_Q_OVERFLOW): the count then comes
    from the watches the kernel still has, which a gone memfd no longer is among."""
    before = RELEASED.held()
    arena = HostArena(SIZE, "lost")
    kept = mmap.mmap(arena.fd(), SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    arena.close()
    monkeypatch.setattr(_inotify, "ignored", lambda fd: ([], True))  # every event lost
    assert RELEASED.held() == before + SIZE
    kept.close()
    assert held_becomes(before)
