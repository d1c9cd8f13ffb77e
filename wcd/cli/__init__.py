"""Command-line entry points: argument parsing and printing only; the logic lives in the library."""

from __future__ import annotations

import sys
from typing import NoReturn


def die(prog: str, message: str, status: int) -> NoReturn:
    """One line on stderr, then exit: users see what went wrong, never a traceback."""
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(status)
