"""Generations of a series: the rules the cache applies to published entries that are one.

Pure logic beside `wcd.cache` (which owns the entries, their indexes and budgets): which number
the next generation takes and whether its publisher and layout may have it, which generation is
current, which are kept for rollback (`previous`) and which must go. Methods that retire
generations mark the leased ones `evicting` and return the unleased ones for the cache to drop.
Entries are the cache's `Entry` (typed loosely here: this module sits under the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wcd.errors import BadRequest, Busy, NotFound, PermissionDenied

SERVED = ("ready", "previous")  # states whose bytes are complete and may be read


@dataclass(eq=False)
class Series:
    """Generations of one published model under one name: the publisher's uid, the layout every
    generation must have, the live generations (oldest first) and which is current (0: none)."""

    name: str
    publisher: int
    layout: str
    generations: dict[int, Any] = field(default_factory=dict)  # number -> Entry
    current: int = 0
    last: int = 0  # the highest generation ever committed: the next reserve is last + 1
    # When each generation was last made current (a counter): retire keeps the most recent ones,
    # so after a rollback the generation rolled back from goes before the known-good ones.
    current_since: dict[int, int] = field(default_factory=dict)
    turns: int = 0

    def make(self, generation: int) -> None:
        self.current = generation
        self.turns += 1
        self.current_since[generation] = self.turns

    def describe(self) -> dict[str, Any]:
        return {"series": self.name, "publisher_uid": self.publisher, "current": self.current,
                "generations": [{"generation": g, "entry": e.name, "state": e.state, "leases": len(e.leases)}
                                for g, e in self.generations.items()]}


class Generations:
    def __init__(self, keep: int) -> None:
        self.keep = keep  # previous generations kept per series (`keep_generations`)
        self.series: dict[str, Series] = {}

    def next(self, name: str, uid: int, admin: bool, layout: str) -> tuple[Series, int]:
        """The series a reserve of `name` publishes into (a new one, not yet registered, for an
        unknown name) and the generation it gets; refusals per the module docstring."""
        known = self.series.get(name)
        if known is None:
            return Series(name, uid, layout), 1
        self._check(known, uid, admin, "publish its next generation")
        filling = [g for g, e in known.generations.items() if e.state == "filling"]
        if filling:
            raise Busy(f"generation {filling[0]} of series {name!r} is being filled: commit or abort it first",
                       {"series": name, "generation": filling[0]})
        if layout != known.layout:
            raise BadRequest(
                f"generation {known.last + 1} of series {name!r} has another layout (tensor names, dtypes, "
                "shapes or offsets) than the series: readers could not move to it in place; publish it as a "
                "new series", {"series": name})
        return known, known.last + 1

    def join(self, entry: Any, series: Series, generation: int) -> None:
        self.series.setdefault(series.name, series)
        entry.series, entry.generation = series, generation
        series.generations[generation] = entry

    def forget(self, entry: Any) -> None:
        """The cache dropped `entry`, a generation: a series goes with its last generation."""
        series = entry.series
        del series.generations[entry.generation]
        series.current_since.pop(entry.generation, None)
        if series.current == entry.generation:
            series.current = 0
        if not series.generations:
            del self.series[series.name]

    def adopted(self, entry: Any, layout: str) -> list[Any]:
        """A generation re-adopted after a restart (its key names series and generation): rejoin its
        series; the newest generation adopted is current. Returns what to drop."""
        name, generation = entry.key.extra.get("series"), entry.key.extra.get("generation", "")
        if name is None or entry.origin != "publish" or entry.publisher is None:
            return []
        if not (generation.isascii() and generation.isdecimal()) or entry.name != f"{name}@{generation}":
            raise BadRequest(f"{entry.name!r} is not a generation {generation!r} of series {name!r}")
        series = self.series.get(name)
        if series is None:
            series = Series(name, entry.publisher, layout)
        elif series.publisher != entry.publisher or series.layout != layout:
            raise BadRequest(f"generation {generation} of series {name!r} does not match its series' publisher "
                             "or layout")
        self.join(entry, series, int(generation))
        series.generations = dict(sorted(series.generations.items()))
        series.last = max(series.last, int(generation))
        series.current_since.setdefault(int(generation), 0)
        if int(generation) > series.current:
            series.make(int(generation))
        return self.retire(series)

    def _check(self, series: Series, uid: int, admin: bool, what: str) -> None:
        if series.publisher != uid and not admin:
            raise PermissionDenied(
                f"series {series.name!r} is published by uid {series.publisher}: only it or an admin may {what}",
                {"series": series.name, "uid": uid})

    def current(self, name: str) -> Any:
        """The current generation of series `name`."""
        series = self.series.get(name)
        if series is None:
            raise NotFound(f"no series named {name!r} (wcdctl list shows what is resident)", {"series": name})
        entry = series.generations.get(series.current)
        if entry is None:
            raise NotFound(f"series {name!r} has no current generation (it was evicted); publish one",
                           {"series": name})
        return entry

    def rollback(self, name: str, uid: int, admin: bool, to: int | None = None) -> tuple[Any, list[Any]]:
        """Make a kept previous generation current again (`to`, or the newest one); the generation
        that was current becomes previous. Returns (the new current, what to drop)."""
        series = self.series.get(name)
        if series is None:
            raise NotFound(f"no series named {name!r} (wcdctl list shows what is resident)", {"series": name})
        self._check(series, uid, admin, "roll it back")
        kept = [g for g, e in series.generations.items() if e.state == "previous" and (to is None or g == to)]
        if not kept:
            which = f"generation {to}" if to is not None else "no previous generation"
            listed = ", ".join(str(g) for g, e in series.generations.items() if e.state == "previous")
            raise NotFound(f"series {name!r}: {which} is not kept to roll back to (keep_generations "
                           f"= {self.keep}; kept: {listed or 'none'})", {"series": name})
        target = series.generations[max(kept, key=lambda g: (series.current_since.get(g, 0), g))]
        old = series.generations.get(series.current)
        if old is not None and old.state == "ready":  # one being evicted stays so
            old.state = "previous"
        target.state = "ready"
        series.make(target.generation)
        return target, self.retire(series)

    def make_current(self, entry: Any) -> list[Any]:
        """A generation was committed: it is current now. Returns what to drop."""
        series = entry.series
        old = series.generations.get(series.current)
        if old is not None and old is not entry and old.state == "ready":
            old.state = "previous"
        series.last = entry.generation
        series.make(entry.generation)
        return self.retire(series)

    def retire(self, series: Series) -> list[Any]:
        """Keep the newest `keep` previous generations; past that, leased ones are `evicting` (they go
        with their last lease) and unleased ones are returned, for the cache to drop now."""
        previous = sorted((g for g, e in series.generations.items() if g != series.current and e.state in SERVED),
                          key=lambda g: (series.current_since.get(g, 0), g), reverse=True)
        drop = []
        for g in previous[self.keep:]:
            entry = series.generations[g]
            if entry.leases:
                entry.state = "evicting"
            else:
                drop.append(entry)
        for g in previous[:self.keep]:
            series.generations[g].state = "previous"
        return drop
