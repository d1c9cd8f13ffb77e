"""Following a series from an engine: tensors at fixed addresses, moved between generations.

`Client.follow` makes one. Imports torch only where tensors are touched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wcd.errors import BadRequest, PermissionDenied, WcdError

if TYPE_CHECKING:
    import torch

class Follower:
    """Follows a series: `tensors` keep their addresses while `update` moves them to another
    generation.

    In place (the default), the tensors are views of the generation's arena and `update` maps
    the next generation's arena behind the same addresses (CUDA: unmap + map of the other
    allocation at the same VA; host: mmap MAP_FIXED over the same range): no bytes copied,
    captured CUDA graphs stay valid. With `copy_into` (an engine that owns its weights: a dict
    of tensors with the series' names and layout), `update` copies the generation into them
    (device to device) instead, and `tensors` are those. Either way an update is whole or not
    at all: on failure the follower stays on the generation it was on.

    Only one thread may call `update` at a time; nothing may run on the tensors during it (the
    engine calls it between steps, as it would load weights).
    """

    def __init__(self, client: Any, series: str, copy_into: Mapping[str, torch.Tensor] | None = None) -> None:
        """`client`: the `wcd.client.Client` whose connection is told of new generations."""
        self.client, self.series = client, series
        self._into = dict(copy_into) if copy_into is not None else None
        self._by_fd = False  # copy-in reads each generation through its descriptor
        self.announced = client.watch(series)  # the current generation, as last announced
        self.lease: Any = None  # a `wcd.client.Lease`; copy-in followers hold none between updates
        try:
            lease = client._acquire_generation(series, None, "map" if self._into is not None else "remappable")
            try:
                self.publisher = self._trusted(lease)  # every later generation must come from it
                self.generation = _number(lease, series)
                self._layout = lease.manifest.layout()
                self._server = client.server.get("pid")  # generation numbers are a daemon's, not for ever
                if self._into is not None:
                    self._check_into(lease)
                    # Host bytes into contiguous CPU tensors: later generations are read from
                    # their memfd (`_copy`), never mapped.
                    self._by_fd = lease.arena.get("kind") == "host" and all(
                        t.device.type == "cpu" and t.is_contiguous() for t in self._into.values())
                    self._copy(lease)
            except BaseException:
                lease.release()
                raise
        except BaseException:
            client.unwatch(series)
            raise
        if self._into is not None:
            lease.release()
        else:
            self.lease = lease
        self.announced = self.generation
        self.taken_s = 0.0  # how long the last update took (acquire, swap or copy, release)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._into is not None:
            return self._into
        if self.lease is None:
            raise WcdError(f"the follower of {self.series!r} is closed")
        return self.lease.tensors

    def poll(self, timeout: float | None = 0.0) -> int:
        """The current generation as last announced, waiting up to `timeout` s (None: until one
        comes) for an announcement while it is the one followed. Announcements of other series
        on the same connection are kept for their own followers (`Client.announced`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            latest = self.client.announced(self.series)
            if latest is not None:
                self.announced = latest
            if self.announced != self.generation:
                return self.announced
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.client.next_event(left) is None:  # reads at least once, even with 0 s left
                latest = self.client.announced(self.series)
                return self.announced if latest is None else latest

    def update(self, generation: int | None = None) -> bool:
        """Move to `generation` (default: the current one); whether the tensors changed."""
        started = time.perf_counter()
        mapping = "fd" if self._into is None or self._by_fd else "map"
        new = self.client._acquire_generation(self.series, generation, mapping)
        try:
            number = _number(new, self.series)
            restarted = self.client.server.get("pid") != self._server  # its numbers start again
            if number == self.generation and not restarted:
                new.release()
                return False
            if new.manifest.layout() != self._layout:
                raise BadRequest(f"generation {number} of {self.series!r} has another layout: it cannot be followed "
                                 "in place")
            if self._trusted(new) != self.publisher:
                raise PermissionDenied(f"generation {number} of {self.series!r} was published by uid "
                                       f"{new.publisher_uid}, not by uid {self.publisher} who published the one "
                                       "followed: not taken", {"series": self.series})
            if self._into is not None:
                try:
                    self._copy(new)
                except BaseException:
                    self.generation = 0  # part copied: neither generation (the next update copies all)
                    raise
                new.release(wait=False)
            else:
                self._swap(new)
        except BaseException:
            new.release()
            raise
        self._server = self.client.server.get("pid")
        old = self.lease
        self.lease = new if self._into is None else None
        self.generation = number
        if old is not None:  # the engine is on the new generation: nothing waits for this
            old.release(wait=False)
        self.taken_s = time.perf_counter() - started
        return True

    def _swap(self, new: Any) -> None:
        """Map `new`'s arena behind the tensors of the lease followed now; `new` then holds that
        mapping and the old lease's mapping object goes (its range now shows `new`'s bytes)."""
        fd = new._arena_fd
        if fd is None:
            raise BadRequest("the new generation's descriptor is gone")
        mapped = self.lease._mapped if self.lease is not None else None
        if mapped is None:
            raise BadRequest("the followed lease is released")
        mapped.remap(new.arena, fd)
        new._adopt_mapping(mapped)
        self.lease._mapped = None

    def _trusted(self, lease: Any) -> int:
        """The publisher of `lease`'s generation, if this engine trusts it (`wcd.integrations.trust`)."""
        from wcd.integrations.trust import accepted_publisher

        if accepted_publisher(self.client, lease) is None:
            raise PermissionDenied(f"{lease.entry} was published by uid {lease.publisher_uid}, whom this process "
                                   "does not trust (its own uid, the daemon's, or the daemon's trusted_publishers)",
                                   {"series": self.series})
        return int(lease.publisher_uid)

    def _check_into(self, lease: Any) -> None:
        """`copy_into` must hold the series' tensors with their dtypes and shapes: a copy_ would
        otherwise broadcast or convert without a word."""
        assert self._into is not None
        source = lease.tensors
        missing = source.keys() ^ self._into.keys()
        if missing:
            raise BadRequest(f"copy_into and generation differ in tensors: {sorted(missing)[:5]}")
        for name, t in self._into.items():
            if t.dtype != source[name].dtype or t.shape != source[name].shape:
                raise BadRequest(f"copy_into[{name!r}] is {t.dtype} {tuple(t.shape)}, the series' is "
                                 f"{source[name].dtype} {tuple(source[name].shape)}")

    def _copy(self, lease: Any) -> None:
        assert self._into is not None
        if lease._arena_fd is not None:
            from wcd.views import read_through_fd

            if lease.arena.get("kind") != "host":
                raise BadRequest(f"{lease.entry} is not in host memory like the generation followed")
            read_through_fd(lease._arena_fd, lease.manifest, self._into)
            return
        from wcd.views import copy_all

        copy_all(self._into, lease.tensors)
        first = next(iter(self._into.values()), None)
        if first is not None and first.is_cuda:
            import torch

            torch.cuda.synchronize(first.device)

    def close(self) -> None:
        """Release the lease and stop watching. Tensors of an in-place follower stay valid (their
        mapping lives while they do) but no longer follow."""
        if self.lease is not None:
            self.lease.release()
        if self.series in self.client._watching:
            self.client.unwatch(self.series)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _number(lease: Any, series: str) -> int:
    """The generation a lease of `series` is on, from its entry's name (`series@N`)."""
    name, at, number = lease.entry.rpartition("@")
    if name != series or not at or not (number.isascii() and number.isdecimal()):
        raise BadRequest(f"{lease.entry!r} is not a generation of series {series!r}")
    return int(number)


def device_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """Where tensors live, as the daemon names devices: a GPU by UUID, else "cpu"."""
    first = next(iter(tensors.values()), None)
    if first is None or not first.is_cuda:
        return "cpu"
    import torch

    return "GPU-" + str(torch.cuda.get_device_properties(first.device).uuid).removeprefix("GPU-")
