"""Pausing Python's cyclic garbage collector while bulk code creates objects that form no cycles.

Parsing a 100,000-tensor header or building 100,000 tensor views creates a million objects, and
each few hundred trigger a collection that walks everything the process holds: that costs as
much as the work itself. GC state is process-wide and the daemon and engines run threads, so
pauses are counted: the collector comes back on when the last pause ends, and only if it was on
when the first began. Nothing else here.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with cyclic GC off (reference counting still frees everything acyclic)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
