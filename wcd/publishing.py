"""The writing side of a `wcd.client.Client` and its series: reserve and publish entries, publish
generations, watch a series and be told of its generations, follow it, roll it back.

`Publishing` is a mixin: `Client` brings the connection (requests, the reading leader, leases),
declared below for the type checker. Imports torch only where tensors are touched.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wcd.errors import DaemonUnavailable, WcdError
from wcd.lease import FillLease, Lease
from wcd.manifest import TENSOR_COLUMNS, Manifest
from wcd.replies import one_fd

if TYPE_CHECKING:
    import torch

    from wcd.follower import Follower
    from wcd.key import WeightCacheKey


class Publishing:
    """Publish and series operations of `wcd.client.Client`; the state below is the Client's."""

    _cond: threading.Condition
    _broken: WcdError | None
    _reading: bool
    _events: deque[dict[str, Any]]
    _watching: set[str]
    _latest: dict[str, int]

    if TYPE_CHECKING:
        def request(self, op: str, **fields: Any) -> dict[str, Any]: ...

        def request_fds(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]: ...

        def ping(self) -> None: ...

        def _track(self, lease: Lease) -> Lease: ...

        def _forget(self, lease: Lease) -> None: ...

        def _end_lease(self, lease: Lease, op: str, wait: bool = True) -> None: ...

        def close(self) -> None: ...

        def _read_for(self, timeout: float | None) -> None: ...

    # -- series: watch, be told, follow, roll back ----------------------------------------------

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next announcement of a watched series (`watch`), waiting up to `timeout` s (None:
        for ever); None if none came. Reads the socket itself when no other thread is reading,
        at least once even with a timeout of 0. A connection the daemon closed (it restarted) is
        opened again, watches included."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tried = False
        while True:
            with self._cond:
                while True:
                    if self._events:
                        return self._events.popleft()
                    broken = self._broken
                    if broken is not None and not isinstance(broken, DaemonUnavailable):
                        raise broken
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if broken is None and tried and left is not None and left <= 0:
                        return None
                    if broken is None and not self._reading:
                        self._reading = True
                        break
                    if broken is not None:
                        break
                    self._cond.wait(left)
            if broken is not None:
                self.ping()  # reconnects and watches again, or raises DaemonUnavailable
                continue
            try:
                tried = True
                self._read_for(left)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def announced(self, series: str) -> int | None:
        """The generation of `series` last announced or seen current on this connection."""
        with self._cond:
            return self._latest.get(series)

    def watch(self, series: str) -> int:
        """Be told (`next_event`) when a generation of `series` becomes current; its current one now (0: none)."""
        generation = int(self.request("watch", series=series)["generation"])
        self._watching.add(series)
        with self._cond:
            self._latest[series] = generation
        return generation

    def unwatch(self, series: str) -> None:
        self.request("watch", series=series, stop=True)
        self._watching.discard(series)

    def rollback(self, series: str, generation: int | None = None) -> dict[str, Any]:
        """Make a kept previous generation of `series` current again (its followers are told)."""
        fields: dict[str, Any] = {"series": series}
        if generation is not None:
            fields["generation"] = generation
        return self.request("rollback", **fields)

    def follow(self, series: str, *, copy_into: Mapping[str, torch.Tensor] | None = None) -> Follower:
        """Acquire the current generation of `series` and follow it (`wcd.follower.Follower`)."""
        from wcd.follower import Follower

        return Follower(self, series, copy_into)

    def _acquire_generation(self, series: str, generation: int | None, mapping: str) -> Lease:
        """A lease on the current generation of `series`, or on generation `generation` of it."""
        target = {"series": series} if generation is None else {"name": f"{series}@{generation}"}
        reply, fds = self.request_fds("acquire", wait=False, **target)
        return self._track(Lease(self, reply, one_fd(fds), mapping=mapping))

    # -- publishing -------------------------------------------------------------------------

    def reserve(self, key: WeightCacheKey, tensors: Mapping[str, tuple[Any, tuple[int, ...]]], *,
                retention: str = "cached", series: str | None = None, mapped: bool = True) -> FillLease:
        """A fill lease on a fresh arena laid out for `tensors` ({name: (dtype, shape)}).
        `mapped=False`: map it only if its `tensors` are asked for (`FillLease.write` writes a
        host arena through its descriptor)."""
        from wcd.views import wire_dtype

        rows = [(name, dtype if isinstance(dtype, str) else wire_dtype(dtype), list(shape))
                for name, (dtype, shape) in tensors.items()]
        columns = Manifest.build(rows).to_wire()  # cheap for the daemon to check at 10^5 tensors
        listing: dict[str, Any] = {"columns": {k: columns[k] for k in TENSOR_COLUMNS}}
        if series is not None:
            listing["series"] = series
        reply, fds = self.request_fds("reserve", key=key.model_dump(), retention=retention, **listing)
        return self._track(FillLease(self, reply, one_fd(fds), "map" if mapped else "fd"))  # type: ignore[return-value]

    def publish(self, key: WeightCacheKey, tensors: Mapping[str, torch.Tensor], *, retention: str = "cached",
                series: str | None = None) -> str:
        """Reserve, copy `tensors` in, commit. Returns the new entry's name. With `series`, the entry
        is that series' next generation (`publish_generation`)."""
        fill = self.reserve(key, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, retention=retention,
                            series=series, mapped=False)
        try:
            fill.write(tensors)
            return fill.commit()
        except BaseException:
            fill.abort()
            raise

    def publish_generation(self, series: str, tensors: Mapping[str, torch.Tensor], *, device: str | None = None,
                           retention: str = "cached") -> int:
        """Publish `tensors` as the next generation of `series` and make it current; returns its
        number. The first generation fixes the series' layout (names, dtypes, shapes, order);
        each next one must match it. `device`: where the arena lives (default: the tensors' GPU,
        by UUID, or host memory for CPU tensors)."""
        from wcd.key import WeightCacheKey

        if device is None:
            from wcd.follower import device_of

            device = device_of(tensors)
        key = WeightCacheKey(model=series, transform="generations", device=device)
        name = self.publish(key, tensors, retention=retention, series=series)
        return int(name.rpartition("@")[2])
