"""The daemon's side of a transfer helper (`wcd.fleet.agent`): start it, ask it, and kill it when
it does not answer in time. Calls block (they run in worker threads, one at a time per helper);
a helper that died or hung is killed and the next call starts a fresh one, so what the old one
held (its registrations, its mappings of arenas) goes with it."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from wcd.errors import WcdError

log = logging.getLogger("wcd")
START_TIMEOUT_S = 60.0  # importing NIXL and making its UCX backend
MAX_MESSAGE = 1 << 20


class HelperFailed(WcdError):
    code = "peer_failed"


class Helper:
    def __init__(self, role: str, env: dict[str, str]) -> None:
        self.role, self._env = role, env
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self.generation = 0  # how many helpers were started: a registration is good for one only

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "wcd.fleet.agent", self.role, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env={**os.environ, **self._env}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=None)
        finally:
            theirs.close()
        self._sock = ours
        self.generation += 1
        try:
            first = self._receive(START_TIMEOUT_S)
        except HelperFailed:
            self._kill()
            raise
        log.info("fleet: %s helper started (pid %s)", self.role, first.get("pid"))

    def _receive(self, timeout: float) -> dict[str, Any]:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except TimeoutError:
            raise HelperFailed(f"the fleet's {self.role} helper did not answer within {timeout:g} s") from None
        except OSError as e:
            raise HelperFailed(f"the fleet's {self.role} helper went away ({e})") from None
        if not data:
            raise HelperFailed(f"the fleet's {self.role} helper went away (exit status "
                               f"{self._proc.poll() if self._proc else None})")
        reply = msgpack.unpackb(data, raw=False)
        assert isinstance(reply, dict)
        return reply

    def call(self, request: dict[str, Any], fds: Sequence[int] = (), timeout: float = 30.0) -> dict[str, Any]:
        """One request, its reply; `HelperFailed` (and the helper killed) if it died or took longer
        than `timeout` s. An `error` in the reply is the helper's own failure, the helper kept."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            assert self._sock is not None
            try:
                socket.send_fds(self._sock, [msgpack.packb(request)], list(fds))
                return self._receive(timeout)
            except HelperFailed:
                self._kill()
                raise
            except OSError as e:
                self._kill()
                raise HelperFailed(f"the fleet's {self.role} helper: {e}") from None

    def ensure(self) -> int:
        """Start the helper if it is not running; its generation."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            return self.generation

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def close(self) -> None:
        with self._lock:
            self._kill()
