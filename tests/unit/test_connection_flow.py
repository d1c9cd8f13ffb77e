"""`Connection`'s flow control, in process over a socketpair: a client that pipelines requests and
then only reads gets every reply, however its replies and the daemon's output limit interleave."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from wcd import connection, protocol
from wcd.connection import Connection, Limits, Quotas

MIB = 1 << 20
LIMITS = Limits(max_connections=4, max_connections_per_uid=4, max_buffer_bytes=100 * MIB,
                max_buffer_bytes_per_uid=100 * MIB, max_fds_per_connection=4, max_fds_per_uid=8, max_fds=16)


async def pipelined(requests: int, reply_bytes: int) -> int:
    """Send `requests` frames in one write, then read until each has its reply (or 5 s pass)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)

    def answer(conn: Connection, message: dict[str, Any]) -> None:
        conn.send({"id": message["id"], "ok": True, "pad": b"x" * reply_bytes})

    conn = Connection(theirs, 0, 0, 0, answer, lambda _: None, Quotas(LIMITS))
    loop = asyncio.get_running_loop()
    ours.setblocking(False)
    await loop.sock_sendall(ours, b"".join(protocol.encode({"op": "ping", "id": i}) for i in range(requests)))
    decoder, got = protocol.FrameDecoder(), 0
    try:
        while got < requests:
            data = await asyncio.wait_for(loop.sock_recv(ours, 1 << 20), 5)
            assert data, "the daemon's end closed"
            decoder.feed(data)
            while decoder.next_message() is not None:
                got += 1
    except TimeoutError:
        pass
    finally:
        conn.close()
        ours.close()
    return got


@pytest.mark.parametrize("high_water", [1, 4096, 64 << 10])
def test_replies_past_the_output_limit_written_at_once_do_not_stall_the_requests_left(
        monkeypatch: pytest.MonkeyPatch, high_water: int) -> None:
    """The batch stops at the output limit; when its replies are all written at once (the client
    reads as fast as they come), the requests already buffered must still be served, with nothing
    more arriving from the client to wake the connection."""
    monkeypatch.setattr(connection, "OUTPUT_HIGH_WATER", high_water)
    assert asyncio.run(pipelined(500, 100)) == 500


def test_a_frame_still_arriving_after_a_full_batch_is_read_not_spun_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """100 requests and the first bytes of a 101st in one write, the rest later: the batch limit
    stops the first pass, the second ends on the partial frame, which is the reader's to finish
    (served again and again, it spun the loop and the last reply never came)."""
    serves = 0
    serve = Connection._serve

    def counted(self: Connection) -> None:
        nonlocal serves
        serves += 1
        serve(self)

    monkeypatch.setattr(Connection, "_serve", counted)

    async def run() -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.setblocking(False)
        ours.setblocking(False)
        conn = Connection(theirs, 0, 0, 0, lambda c, m: c.send({"id": m["id"], "ok": True}), lambda _: None,
                          Quotas(LIMITS))
        loop = asyncio.get_running_loop()
        frames = [protocol.encode({"op": "ping", "id": i}) for i in range(101)]
        await loop.sock_sendall(ours, b"".join(frames[:100]) + frames[100][:3])
        decoder, got = protocol.FrameDecoder(), 0
        try:
            while got < 100:
                decoder.feed(await asyncio.wait_for(loop.sock_recv(ours, 1 << 20), 5))
                while decoder.next_message() is not None:
                    got += 1
            await asyncio.sleep(0.2)  # a spinning connection would serve thousands of times meanwhile
            await loop.sock_sendall(ours, frames[100][3:])
            decoder.feed(await asyncio.wait_for(loop.sock_recv(ours, 1 << 20), 5))
            while decoder.next_message() is not None:
                got += 1
        finally:
            conn.close()
            ours.close()
        return got

    assert asyncio.run(run()) == 101
    assert serves < 20, f"{serves} passes over the connection's buffer"
