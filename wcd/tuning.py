"""How loads read and copy: `LoadTuning`, the sizes an arena backend is built with. The defaults
are what the daemon uses; benchmarks build backends with variants of it (`wcd.arenas.set_tuning`).
Why each default is what it is: bench/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadTuning:
    # A lane's pinned buffers (GPU) and a loader thread's scratch (host): files mostly in the page
    # cache are read one buffer at a time; two per lane, one read into while the other is copied.
    staging_bytes: int = 4 << 20
    staging_buffers: int = 2
    # Files mostly not in the page cache are planned in ops of this size, and read buffered one op
    # at a time (a lane's buffers grow to it then), or with O_DIRECT in spans of `direct_read_bytes`
    # (whole blocks around the wanted bytes, in the buffers a lane has).
    cold_read_bytes: int = 16 << 20
    direct_read_bytes: int = 512 << 10
    # verify's device-to-host copies: cache-sized, so hashing one overlaps the copy of the next.
    read_window: int = 4 << 20
    # Tensor bytes of cold files the kernel is asked to read ahead while a writer is being made
    # (a GPU writer waits for its context and pinned buffers meanwhile); 0: none.
    read_ahead_bytes: int = 256 << 20
    # A tensor of at least its file's batch is copied in pieces of this many bytes, one op each, so
    # that several loader threads read a large tensor at once.
    chunk_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < (0 if f.name == "read_ahead_bytes" else 1):
                raise ValueError(f"LoadTuning.{f.name} must be a positive int of bytes, got {value!r}")


DEFAULT = LoadTuning()
