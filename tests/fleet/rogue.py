"""A peer that knows the secret but serves other bytes than the digest it announces (run in a
namespace by the fault tests): `python -m tests.fleet.rogue HOST:PORT SECRET_FILE SIZE DIGEST`.
It answers every `want` for any key with an arena of random bytes, exported by wcd's own helper."""

from __future__ import annotations

import asyncio
import os
import sys

from wcd.config import parse_host_port
from wcd.fleet.channel import ChannelError, accept
from wcd.fleet.helpers import Helper


async def main() -> None:
    (host, port), secret = parse_host_port(sys.argv[1]), open(sys.argv[2], "rb").read().strip()
    size, digest = int(sys.argv[3]), sys.argv[4]
    fd = os.memfd_create("rogue")
    os.write(fd, os.urandom(size))
    helper = Helper("export", {k: v for k, v in os.environ.items() if k.startswith("UCX_")})
    reply = await asyncio.to_thread(helper.call, {"op": "export", "id": 1, "size": size}, [fd])
    await asyncio.to_thread(helper.call, {"op": "serve", "id": 1, "deadline_s": 600})

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            channel = await accept(reader, writer, secret, 5, "peer")
            while True:
                msg = await channel.recv(60)
                if msg.get("op") == "want":
                    key = {k: msg.get(k) for k in ("model", "path", "fingerprint", "dtype", "transform", "shard",
                                                   "extra")}
                    await channel.send({"ok": True, "xfer": 1, "md": reply["md"], "addr": reply["addr"],
                                        "size": size, "digest": digest, "key": key, "retention": "pinned"})
        except ChannelError:
            writer.close()

    server = await asyncio.start_server(serve, host, port)
    print("serving", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
