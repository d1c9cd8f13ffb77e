"""Command-line entry points: argument parsing and printing only; the logic lives in the library."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def die(prog: str, message: str, status: int) -> NoReturn:
    """One line on stderr, then exit: users see what went wrong, never a traceback."""
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(status)


def quiet_on_closed_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """`wcdctl list | head -1`: a reader that stops reading is the reader's choice, not an error.

    Exits 0 with nothing on stderr. stdout is pointed at /dev/null first, so the interpreter's
    final flush of what is still buffered does not fail again on the way out.
    """

    @functools.wraps(main)
    def wrapper(*args: object, **kwargs: object) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()
            return status
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 0

    return wrapper


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line with where to look (`wcdctl: unknown
    command 'x' ...`), exit status 2, instead of the usage block: the same shape as every other error."""

    def error(self, message: str) -> NoReturn:
        root = self.prog.split()[0]
        die(root, f"{message} (see {self.prog} --help)", 2)
