"""Verify: what is resident against what it should be, and the digests that take.

A published entry is compared with the digest taken when it was committed (or re-adopted after a
restart); a loaded one with its checkpoint on disk, read again. Hashing runs in the digest pool,
holding the arena; requests that come while one verify runs share its result (the bytes are
sealed, so the answer cannot change meanwhile).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcd.checkpoint import Checkpoint
from wcd.errors import NotFound
from wcd.life import Digests, life
from wcd.loader import content_digest, digest_arena, verify_arena
from wcd.offloop import produced, quiet, using

if TYPE_CHECKING:
    from wcd.cache import Entry


@dataclass(frozen=True, slots=True)
class Verification:
    """What `verify` found."""

    digest: str  # the content digest of what is resident (`loader.content_digest`)
    tensors: int
    mismatched: list[str]  # sorted
    against: str


def _verification(actual: Digests, mismatched: list[str], against: str) -> Verification:
    """(in a worker: for 10^5 tensors this takes a while)"""
    return Verification(content_digest(actual), len(actual), mismatched, against)


class Verifier:
    def __init__(self, pool: Executor, parse_with: Any) -> None:
        self._pool = pool
        self._parse_with = parse_with  # Checkpoint.open's `helpers`

    def keep_digest(self, entry: Entry, source: str) -> None:
        """Digest an entry in the background: what verify compares a published one against later,
        and what an acquire asking for a content digest is checked against."""
        future = asyncio.ensure_future(self.digest(entry))
        future.add_done_callback(quiet)  # an eviction stops it: nothing to report then
        life(entry).digest = (future, source)

    async def digest(self, entry: Entry) -> Digests:
        manifest = entry.manifest
        return await using(self._pool, entry.arena, lambda arena: digest_arena(arena, manifest))

    async def shared(self, entry: Entry, follow_links: bool) -> Verification:
        """`run`, or the run already under way for `entry`. The caller holds a lease on it."""
        record = life(entry)
        if record.verifying is None:
            running = record.verifying = asyncio.ensure_future(self.run(entry, follow_links))

            def done(future: asyncio.Future[Any]) -> None:
                record.verifying = None
                quiet(future)

            running.add_done_callback(done)
        return await asyncio.shield(record.verifying)

    async def run(self, entry: Entry, follow_links: bool) -> Verification:
        if entry.origin == "publish":
            actual = await self.digest(entry)
            kept = life(entry).digest
            assert kept is not None, entry.name
            expected = await asyncio.shield(kept[0])

            def compare() -> Verification:
                differ = sorted(n for n in actual.keys() | expected.keys() if actual.get(n) != expected.get(n))
                return _verification(actual, differ, kept[1])

            return await asyncio.to_thread(compare)
        if not Path(entry.key.path).exists():
            raise NotFound(f"{entry.key.path} is gone: nothing to verify {entry.name!r} against")
        ckpt = await produced(lambda: Checkpoint.open(entry.key.path, follow_links, helpers=self._parse_with))
        try:
            # One pass: each worker reads a range of the arena and the same tensors' bytes from
            # the files, compares them and hashes the arena's side only.
            manifest, against = entry.manifest, str(ckpt.path)
            return await using(self._pool, entry.arena,
                               lambda arena: _verification(*verify_arena(arena, manifest, ckpt), against))
        finally:
            ckpt.close()
