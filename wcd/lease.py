"""An engine's side of a lease: `Lease` (read) and `FillLease` (from `reserve`), zero-copy views
of an arena mapped in this process. `wcd.client.Client` makes and renews them; import them from
there (`from wcd.client import Lease`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from wcd.errors import WcdError
from wcd.replies import decoding, entry_name, field, validated_manifest

if TYPE_CHECKING:
    import torch

    from wcd.key import WeightCacheKey
    from wcd.views import MappedArena


class Holder(Protocol):
    """What a lease needs of the connection that holds it (`wcd.client.Client`)."""

    def request(self, op: str, **fields: Any) -> dict[str, Any]: ...

    def _forget(self, lease: Lease) -> None: ...

    def _end_lease(self, lease: Lease, op: str, wait: bool = True) -> None: ...

    def close(self) -> None: ...


class Lease:
    """A read lease: zero-copy tensor views of a resident entry, kept alive by heartbeats.

    Views stay valid after `release()` (and if the daemon dies), for host and CUDA arenas alike:
    the mapping lives as long as any view and is unmapped when the last one is freed.
    """

    kind = "read"

    def __init__(self, client: Holder, reply: dict[str, Any], fd: int, mapping: str = "map") -> None:
        """`mapping`: "map" the arena, map it "remappable" (`Follower`), or keep its "fd" unmapped
        (to be mapped in place of another generation: `Follower`)."""
        self.client = client
        self.lost = False  # set when a heartbeat finds the daemon no longer holds this lease
        self.released = False
        self._mapped: MappedArena | None = None
        self._arena_fd: int | None = None
        try:
            with decoding(f"{self.kind} lease reply"):
                self.id: int = field(reply, "lease", int)
            self.entry: str = entry_name(reply)
            self._key_wire = reply.get("key")
            # Whose bytes these are: the daemon's own loads ("config"/"load") or a publisher's uid.
            self.origin: str | None = reply.get("origin")
            self.publisher_uid: int | None = reply.get("publisher_uid")
            self.asked_by: int | None = reply.get("asked_by")  # whose `load` made it (origin "load")
            with decoding(f"the manifest of {self.entry!r}"):
                self.manifest = validated_manifest(reply.get("manifest"))
                self.arena: dict[str, Any] = field(reply, "arena", dict)
        except BaseException:
            os.close(fd)
            if hasattr(self, "id"):
                self.client._end_lease(self, "abort" if self.kind == "fill" else "release")
            raise
        if mapping == "fd":
            self._arena_fd = fd
            return
        try:
            from wcd.views import map_arena

            with decoding(f"the arena of {self.entry!r}"):
                self._mapped = map_arena(self.arena, fd, self.manifest, writable=self.kind == "fill",
                                         remappable=mapping == "remappable")
        except BaseException:
            self.client._end_lease(self, "abort" if self.kind == "fill" else "release")
            raise

    @property
    def key(self) -> WeightCacheKey:
        """The entry's full key (validated on first use: it needs pydantic, an attach does not)."""
        from wcd.key import WeightCacheKey

        if not isinstance(self._key_wire, WeightCacheKey):
            with decoding(f"the key of {self.entry!r}"):
                self._key_wire = WeightCacheKey.model_validate(self._key_wire)
        return self._key_wire

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._mapped is None:
            raise WcdError(f"lease {self.id} on {self.entry} is released: its views are gone")
        return self._mapped.tensors

    def release(self, wait: bool = True) -> None:
        """End the lease. `wait=False`: without waiting for the daemon's answer (it ends the lease
        before anything this connection sends next)."""
        if self.released:
            return
        self.released = True
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self._close_fd()
        self.client._end_lease(self, "release", wait)

    def _close_fd(self) -> None:
        if self._arena_fd is not None:
            os.close(self._arena_fd)
            self._arena_fd = None

    def _adopt_mapping(self, mapped: MappedArena) -> None:
        """This lease's arena is now what `mapped` maps (`Follower`): its fd is no longer needed."""
        self._mapped = mapped
        self._close_fd()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<wcd.Lease {self.id} {self.kind} {self.entry} {len(self.manifest)} tensors>"


class FillLease(Lease):
    """A fill lease from `reserve`: a fresh arena to write (`write`, or writable `tensors`
    views); `commit()` or `abort()`. Reserved with `mapped=False`, the arena is mapped only if
    `tensors` is asked for."""

    kind = "fill"

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._mapped is None and self._arena_fd is not None and not self.released:
            from wcd.views import map_arena

            fd, self._arena_fd = self._arena_fd, None
            with decoding(f"the arena of {self.entry!r}"):
                self._mapped = map_arena(self.arena, fd, self.manifest, writable=True)
        return super().tensors

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `tensors` ({name: tensor} with the reserved dtypes and shapes) into the arena.
        CPU tensors into a host arena not mapped here go through its descriptor (pwrite): no page
        faults, and no mapping whose page tables `commit` must tear down before the daemon can
        seal the arena. Anything else is copied through the views (device to device on a GPU)."""
        if self.released:
            raise WcdError(f"lease {self.id} on {self.entry} is committed or aborted: nothing can be written")
        from wcd.views import write_through_fd, write_views

        if (self._mapped is None and self._arena_fd is not None and self.arena.get("kind") == "host"
                and all(t.device.type == "cpu" for t in tensors.values())):
            write_through_fd(self._arena_fd, self.manifest, tensors)
        else:
            write_views(self.tensors, tensors)

    def commit(self) -> str:
        """Make the entry ready for everyone. Every reference to `tensors` must be dropped first."""
        if self._mapped is not None:
            self._mapped.unmap_writable()
            self._mapped = None
        self._close_fd()
        reply = self.client.request("commit", lease=self.id)
        self.released = True
        self.client._forget(self)
        return entry_name(reply)

    def abort(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self._close_fd()
        if not self.released:
            self.released = True
            self.client._end_lease(self, "abort")

    def release(self, wait: bool = True) -> None:
        self.abort()

    def __exit__(self, *exc: object) -> None:
        if not self.released:
            self.abort()
