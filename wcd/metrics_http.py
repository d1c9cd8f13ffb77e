"""`GET /metrics` over HTTP, so Prometheus can scrape the daemon (`[daemon] metrics_listen`).

Serves exactly one thing, the text exposition of the daemon's metrics registry, on the event loop
with asyncio streams: every other path is 404, every other method 405. Requests are bounded in size
and time and connections in number, so a slow or hostile client cannot hold the endpoint or the
loop: when every slot is taken, the connection that has waited longest for its request head makes
room (a scraper sends its head at once; clients that trickle theirs are the ones that go). This
module knows nothing about the server beyond the `render` callable it is given.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Awaitable, Callable

from wcd.errors import ConfigError

log = logging.getLogger("wcd.metrics_http")

PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format 0.0.4
MAX_REQUEST_BYTES = 8192  # request line + headers; scrapers send a few hundred bytes
REQUEST_TIMEOUT_S = 5.0  # to receive the whole request head
WRITE_TIMEOUT_S = 10.0  # to hand over the response
# At once; past it the longest still sending its head is closed unanswered. Within the descriptors
# the daemon keeps out of its peers' budgets (`wcd.server._fd_reserve`, 128 at least past a 1024 limit).
MAX_CONNECTIONS = 128
# Connections not yet accepted: room for a scrape while others come and go (a full backlog drops
# its SYN, and it tries again only a second later).
BACKLOG = 4 * MAX_CONNECTIONS
# What socket()/bind() fail with under wcd@.service's RestrictAddressFamilies=AF_UNIX / IPAddressDeny=.
_SANDBOXED = (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES)


class MetricsHttp:
    """One listening TCP socket answering `GET /metrics`. `await start()`, later `await stop()`."""

    def __init__(self, host: str, port: int, render: Callable[[], Awaitable[str]]) -> None:
        self.host, self.port = host, port
        self._render = render
        self._server: asyncio.AbstractServer | None = None
        # Each client's task -> whether its head is in (insertion order: the oldest first).
        self._clients: dict[asyncio.Task[None], bool] = {}

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{PATH}"

    async def start(self) -> None:
        sock = self._bind()
        self._server = await asyncio.start_server(self._serve, sock=sock, limit=MAX_REQUEST_BYTES)
        self.port = sock.getsockname()[1]  # the one picked, for port 0
        log.info("metrics on %s", self.url)

    def _bind(self) -> socket.socket:
        # Bound here rather than by start_server, which can skip an address whose socket() fails
        # (as under RestrictAddressFamilies=) and then serve on no socket at all, silently.
        where = f"daemon.metrics_listen: cannot listen on {self.host}:{self.port}"
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as e:
            raise ConfigError(f"{where} ({e.strerror})") from None
        sock: socket.socket | None = None
        try:
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError as e:
            if sock is not None:
                sock.close()
            hint = ("; under wcd@.service allow TCP with a drop-in (see the comments in wcd@.service)"
                    if e.errno in _SANDBOXED else "")
            raise ConfigError(f"{where} ({os.strerror(e.errno) if e.errno else e}){hint}") from None
        return sock

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._clients) >= MAX_CONNECTIONS:
            oldest = next((t for t, head_in in self._clients.items() if not head_in), None)
            if oldest is None:  # all of them are being answered
                writer.close()
                return
            oldest.cancel()
            del self._clients[oldest]
        self._clients[task] = False
        try:
            status, body = await self._answer(reader, task)
            headers = {"Content-Type": CONTENT_TYPE if status.startswith("200") else "text/plain; charset=utf-8",
                       "Content-Length": str(len(body)), "Connection": "close"}
            if status.startswith("405"):
                headers["Allow"] = "GET"
            head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            writer.write(head.encode() + body)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            pass  # the client went away or stopped reading: nothing to tell it
        finally:
            self._clients.pop(task, None)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, task: asyncio.Task[None]) -> tuple[str, bytes]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)  # the whole head
            if task in self._clients:  # not made room with meanwhile
                self._clients[task] = True
        except asyncio.LimitOverrunError:
            return "431 Request Header Fields Too Large", b"request too large\n"
        except asyncio.TimeoutError:
            return "408 Request Timeout", b"request not received in time\n"
        except asyncio.IncompleteReadError:
            return "400 Bad Request", b"incomplete request\n"
        method, target, version = (head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", "", ""])[:3]
        if not version.startswith("HTTP/1."):
            return "400 Bad Request", b"not an HTTP/1.x request\n"
        if target.split("?", 1)[0] != PATH:
            return "404 Not Found", f"only {PATH} is served here\n".encode()
        if method != "GET":
            return "405 Method Not Allowed", b"only GET\n"
        return "200 OK", (await self._render()).encode()
