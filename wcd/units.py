"""Sizes for people and for config files: `parse_size` reads "64GiB", "1.5 TB" or "90%" of a
device; `format_size` and `format_progress` print bytes in the unit that fits, `describe_progress`
a load's phase, rate and time left, `format_duration` seconds, `counted` a count with its noun.
No wcd imports.
"""

from __future__ import annotations

import re
from typing import Any

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str, total: int | None = None) -> int:
    """Bytes from 123, "64GiB", "1.5 TB" or, given the device `total`, a fraction like "90%"."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected bytes with a unit (\"64GiB\") or a fraction (\"90%\"), got {value!r}")
    s = value.strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"cannot read fraction {value!r}: use a percentage like \"90%\"") from None
        if not 0 < pct <= 100:
            raise ValueError(f"fraction {value!r} must be in (0%, 100%]")
        if total is None:
            return -1  # resolved against the device total later
        return int(total * pct / 100)
    m = _SIZE.match(s)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {value!r}: use bytes with a unit like \"64GiB\" or \"500MB\", or \"90%\"")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    """Bytes for people, in the unit that fits: "512 B", "25.0 MiB", "3.4 GiB"."""
    scale, unit = _fitting_unit(n)
    return f"{n:.0f} {unit}" if unit == "B" else f"{n / scale:.1f} {unit}"


def counted(n: int, what: str) -> str:
    """A count for people: "1 entry", "2 entries", "0 leases"."""
    many = what[:-1] + "ies" if what.endswith("y") else what + "s"
    return f"{n} {what if n == 1 else many}"


def format_progress(done: int, total: int) -> str:
    """Load progress for people, both sizes in the unit that fits the total: "45% 63.0/140.0 GiB"."""
    scale, unit = _fitting_unit(total)
    digits = 0 if unit == "B" else 1
    return f"{100 * done // max(total, 1)}% {done / scale:.{digits}f}/{total / scale:.{digits}f} {unit}"


def describe_progress(progress: dict[str, Any]) -> str:
    """A load's progress (`Entry.describe()["progress"]`) for people: "reading 45% 1.7/3.8 GiB,
    350.0 MiB/s, 6s left"; the phase first when the daemon names one."""
    text = format_progress(progress["done"], progress["total"])
    phase = progress.get("phase")
    if progress.get("rate"):
        text += f", {format_size(progress['rate'])}/s"
        if progress.get("eta_s") is not None:
            text += f", {format_duration(progress['eta_s'])} left"
    return f"{phase} {text}" if phase else text


def format_duration(seconds: float) -> str:
    """Seconds for people: "45s", "3m05s", "2h10m"."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fitting_unit(n: float) -> tuple[int, str]:
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if abs(n) < 1024 ** (power + 1):
            return 1024**power, unit
    return 1024**4, "TiB"
