"""The fleet's control channel over a real TCP socket: mutual proof of the shared secret, frames
authenticated after it; and the `[fleet]` config. No NIXL needed."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from wcd.config import FleetConfig, load_config
from wcd.errors import ConfigError
from wcd.fleet.channel import HANDSHAKE_BYTES, Channel, ChannelError, accept, connect

SECRET = b"s" * 40


async def _pair(server_secret: bytes, client_secret: bytes) -> tuple[Any, Any]:
    """(what the acceptor got: a Channel or the error, same for the connector)."""
    accepted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            accepted.set_result(await accept(reader, writer, server_secret, 5.0, "test"))
        except ChannelError as e:
            accepted.set_result(e)
            writer.close()

    server = await asyncio.start_server(on, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client: Any = await connect("127.0.0.1", port, client_secret, 5.0)
    except ChannelError as e:
        client = e
    got = await asyncio.wait_for(accepted, 5)
    server.close()
    return got, client


def test_both_sides_prove_the_secret_and_then_talk() -> None:
    async def main() -> None:
        server, client = await _pair(SECRET, SECRET)
        assert isinstance(server, Channel) and isinstance(client, Channel)
        await client.send({"op": "want", "model": "m"})
        assert await server.recv(5) == {"op": "want", "model": "m"}
        await server.send({"ok": True, "n": 1})
        assert await client.recv(5) == {"ok": True, "n": 1}
        client.close()
        server.close()

    asyncio.run(main())


def test_a_peer_without_the_secret_gets_nothing_either_way() -> None:
    async def main() -> None:
        server, client = await _pair(SECRET, b"x" * 40)
        assert isinstance(server, ChannelError) and "does not know the fleet's shared secret" in server.message
        assert isinstance(client, ChannelError)
        server, client = await _pair(b"x" * 40, SECRET)  # an impostor acceptor: the connector refuses it
        assert isinstance(client, ChannelError)

    asyncio.run(main())


def test_a_frame_changed_replayed_or_injected_on_the_way_is_refused() -> None:
    async def main() -> None:
        for change in ("flip", "replay"):
            server, client = await _pair(SECRET, SECRET)
            await client.send({"op": "want", "model": "m"})
            reader = server._reader
            head = await reader.readexactly(4)
            first = head + await reader.readexactly(struct.unpack(">I", head)[0])
            frame = bytearray(first)
            if change == "flip":  # a third party rewriting one byte of the body
                frame[8] ^= 1
                reader.feed_data(bytes(frame))
            else:  # the same frame, authentic once, sent twice
                reader.feed_data(first + first)
                assert await server.recv(5) == {"op": "want", "model": "m"}
            with pytest.raises(ChannelError, match="authentication tag"):
                await server.recv(5)
            client.close()
            server.close()

    asyncio.run(main())


def test_an_unauthenticated_peer_cannot_make_it_read_a_large_frame() -> None:
    async def main() -> None:
        accepted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await accept(reader, writer, SECRET, 5.0, "test")
            except ChannelError as e:
                accepted.set_result(e)
            writer.close()

        server = await asyncio.start_server(on, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(struct.pack(">I", 1 << 30))  # announces a GB before proving anything
        await writer.drain()
        err = await asyncio.wait_for(accepted, 5)
        assert f"at most {HANDSHAKE_BYTES}" in err.message
        writer.close()
        server.close()

    asyncio.run(main())


SECRET = b"0123456789abcdefghijklmnopqrstuvwxyzABCD"  # text, as `base64` writes one


def _config(tmp_path: Path, secret_mode: int = 0o600, secret: bytes = SECRET + b"\n", extra: str = "") -> Any:
    path = tmp_path / "secret"
    path.write_bytes(secret)
    path.chmod(secret_mode)
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[[models]]\nname = "m"\npath = "{tmp_path}/absent"\n[fleet]\nlisten = "127.0.0.1:7450"\n'
                   f'secret_file = "{path}"\npeers = ["10.0.0.2:7450"]\noffer = {{ cpu = "1GiB" }}\n{extra}')
    return load_config(cfg)


def test_fleet_config(tmp_path: Path) -> None:
    config = _config(tmp_path)  # a missing checkpoint is allowed: a peer may hold it
    assert config.fleet is not None and config.fleet.offered_bytes("cpu") == 1 << 30
    assert config.fleet.offered_bytes("cuda:0") == 0
    assert config.fleet.read_secret(os.getuid()) == SECRET  # newline stripped
    with pytest.raises(ConfigError, match="no one else may read"):
        _config(tmp_path, 0o644).fleet.read_secret(os.getuid())
    with pytest.raises(ConfigError, match="32 or more"):
        _config(tmp_path, secret=b"short").fleet.read_secret(os.getuid())
    with pytest.raises(ConfigError, match="fleet.ucx.*only UCX_"):
        _config(tmp_path, extra='ucx = { LD_PRELOAD = "/tmp/x.so" }')
    with pytest.raises(ValidationError, match="expected host:port"):
        FleetConfig.model_validate({"listen": "x:1", "secret_file": "/s", "peers": ["nope"]})


def test_without_fleet_a_missing_checkpoint_is_still_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[[models]]\nname = "m"\npath = "{tmp_path}/absent"\n')
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(cfg)


def test_the_daemon_imports_nothing_of_the_fleet_unless_configured() -> None:
    import subprocess
    import sys

    code = ("import sys, wcd.server, wcd.cli.wcd, wcd.residency\n"
            "print(sorted(m for m in sys.modules if m.startswith(('wcd.fleet', 'nixl'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "[]"
