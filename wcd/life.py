"""An entry's life record: which phase of its life in memory it is in, and what it owns there.

The cache (`wcd.cache`) decides *whether* an entry lives (budgets, leases, eviction); this record
holds what its life in this process has opened, so that ending it is one step (`end`) whatever
phase it ended in. One record per entry, on `Entry.life`; only `wcd.residency` changes it.

    phase       owns (besides the arena, on `Entry.arena`)
    admitted    the checkpoint's open shards, until the fill takes them
    filling     nothing more (the fill closes the checkpoint it took)
    checking    re-adopted after a restart: the fd-store record and the arena fd until opened
    ready       the digest a published entry is verified against; a running verify;
                its place in systemd's fd store (`parked`)
    reclaimed   nothing: `end` closed it all

`superseded` (a reload changed the entry's model while it was leased or loading: load the new
one when this one goes) and `parked` hold across phases. `ready` is set when the entry leaves
admitted/filling/checking, whether it became ready or went away.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from wcd import parking, systemd
from wcd.offloop import close_later

if TYPE_CHECKING:
    from wcd.cache import Entry
    from wcd.checkpoint import Checkpoint

log = logging.getLogger("wcd")

Phase = Literal["admitted", "filling", "checking", "ready", "reclaimed"]
Digests = dict[str, str]


@dataclass(eq=False)
class Life:
    phase: Phase = "admitted"
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    checkpoint: Checkpoint | None = None
    adopted: tuple[parking.ParkedEntry, int] | None = None  # (record, arena fd) until checked
    digest: tuple[asyncio.Future[Digests], str] | None = None  # (digest, what it was taken at)
    verifying: asyncio.Future[Any] | None = None  # shared by the verify requests that come meanwhile
    committing: bool = False  # a commit is sealing the arena
    parked: bool = False
    superseded: bool = False

    @property
    def loading(self) -> bool:
        """Whether the fill, or the check after a restart, has not ended yet."""
        return self.phase in ("admitted", "filling", "checking")

    def start_fill(self) -> Checkpoint | None:
        """admitted -> filling: the checkpoint is the fill's to close from now on (None: it is not on
        this host, and only the fleet's peers can fill the entry)."""
        assert self.phase == "admitted", self.phase
        ckpt, self.checkpoint, self.phase = self.checkpoint, None, "filling"
        return ckpt

    def start_check(self) -> tuple[parking.ParkedEntry, int]:
        """checking: the arena fd is the check's to open (or close) from now on."""
        assert self.phase == "checking" and self.adopted is not None, self.phase
        adopted, self.adopted = self.adopted, None
        return adopted

    def became_ready(self) -> None:
        assert self.phase in ("filling", "checking", "admitted"), self.phase
        self.phase = "ready"
        self.ready.set()

    def end(self, entry: Entry) -> None:
        """-> reclaimed, from any phase: close what the entry owns. Idempotent."""
        if self.phase == "reclaimed":
            return
        self.phase = "reclaimed"
        if self.parked:
            self.parked = False
            for name in parking.fd_names(entry.key, entry.publisher):
                unstore(name)
        if entry.arena is not None:
            close_later(entry.arena)
            entry.arena = None
        if self.checkpoint is not None:
            self.checkpoint.close()
            self.checkpoint = None
        if self.adopted is not None:
            os.close(self.adopted[1])
            self.adopted = None
        self.digest = None
        self.ready.set()


def life(entry: Entry) -> Life:
    """The entry's record (the cache creates entries without one: residency gives each its own)."""
    record = entry.life
    assert isinstance(record, Life), entry.name
    return record


def unstore(name: str) -> None:
    """Remove an fd from systemd's fd store; a failure is logged, never fatal."""
    try:
        systemd.remove_fds(name)
    except (systemd.SystemdError, ValueError) as e:
        log.warning("systemd: %s", e)
