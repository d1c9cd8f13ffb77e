"""Daemon configuration: pydantic schema, TOML loading, byte sizes and fractions.

`load_config` turns any problem (missing file, bad TOML, wrong type, unknown key, missing model
path, unknown group) into one `ConfigError` line that names the field. Nothing here starts
anything or touches devices: fractions like "90%" are resolved later against device totals.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from wcd import HOST_DEVICE
from wcd.configfile import CONFIG_DIR, RUN_DIR, instance_config_path, read_toml
from wcd.errors import ConfigError
from wcd.peers import group_gids
from wcd.units import parse_size
from wcd.wire import Retention

__all__ = ["CONFIG_DIR", "RUN_DIR", "Config", "FleetConfig", "ModelConfig", "instance_config_path", "load_config"]
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# What a device may be called: host memory, a CUDA ordinal, or a GPU UUID (`wcd.arenas.cudrv.resolve_gpu`).
_DEVICE = re.compile(r"cpu|cuda(?::\d{1,4})?|GPU-[0-9A-Fa-f-]{1,64}")


def check_device(name: str) -> str:
    """`name` if it is spelled like a device; `ValueError` saying how to spell one otherwise. Whether
    that GPU exists is known only when the daemon starts (`wcd.devices.device_budgets`)."""
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"unknown device {name!r}: use \"cpu\", \"cuda:N\" or a GPU UUID (\"GPU-...\")")
    return name


def parse_host_port(value: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464"; IPv6 in brackets ("[::1]:9464"); port 0 picks one."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", value.strip())
    port = int(m.group(2) or m.group(4)) if m else -1
    if not m or port > 65535:
        raise ValueError(f"expected host:port like \"127.0.0.1:9464\" or \"[::1]:9464\", got {value!r}")
    return m.group(1) or m.group(3), port


Size = Annotated[StrictInt | str, Field(union_mode="left_to_right")]


def _bytes(value: object) -> object:
    return parse_size(value) if isinstance(value, str) and not value.strip().endswith("%") else value


MIB = 1 << 20
# Buffer limits hold at least one largest frame (wire.MAX_FRAME_BYTES, 32 MiB).
BufferBytes = Annotated[StrictInt, BeforeValidator(_bytes), Field(ge=32 * MIB, le=1 << 40)]


class DaemonConfig(BaseModel):
    """`[daemon]`. Roles (DESIGN §10): every allowed peer reads and publishes (its entries carry
    its uid); admins (root, the daemon's own uid, `admin_uids`, members of `admin_groups`) also
    load, evict configured or others' entries, and pin."""

    model_config = ConfigDict(extra="forbid")

    socket: Path | None = None
    lease_ttl_s: Annotated[float, Field(gt=0.05, le=3600)] = 30.0
    allowed_uids: list[Annotated[int, Field(ge=0)]] = []
    allowed_groups: list[str] = []
    # Admins besides root and the daemon's own uid (uids, and groups by name, primary or supplementary).
    admin_uids: list[Annotated[int, Field(ge=0)]] = []
    admin_groups: list[str] = []
    # Publishers whose entries integrations accept besides their own uid and the daemon's; sent to
    # clients in hello (at most 1024 uids).
    trusted_publishers: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1024)] = []
    budget: dict[str, Size] = {}
    load_workers: Annotated[int, Field(ge=1, le=256)] | None = None
    # Processes that parse large safetensors headers beside each other (wcd.header_helpers); 0:
    # parsed in the daemon; unset: one per 2 cores on hosts of 4 or more, at most 8. Read at start-up.
    header_helpers: Annotated[int, Field(ge=0, le=64)] | None = None
    # Seconds a GPU's CUDA context and pinned staging stay after its last load, for the next one
    # (0: released as the load ends, beside its answer; inf: kept while the daemon runs, a context's
    # memory on each GPU). A GPU in exclusive-process compute mode keeps nothing after a load, released
    # before the answer: engines could not create a context.
    staging_linger_s: Annotated[float, Field(ge=0)] = 30.0
    # How a GPU load reads files that are not in the page cache: "direct" (O_DIRECT in 512 KiB
    # reads into pinned buffers, except the parts the page cache holds: faster than buffered on
    # the GPU hosts measured, bench/RESULTS.md; buffered where the file system refuses it, said
    # once per file system) or "buffered" (through the page cache in 16 MiB reads, read ahead
    # while the load's CUDA context is made, then dropped for files that were not in it at all).
    cold_reads: Literal["buffered", "direct"] = "direct"
    # Entries hashed at once (verify, the digest after a commit), 1..64; others queue in their own
    # pool, never in front of short work (allocations, seals, manifests). Read at start-up.
    digest_workers: Annotated[int, Field(ge=1, le=64)] = 2
    # verify requests in flight per uid, 1..1024; more are answered busy.
    max_verifies_per_uid: Annotated[int, Field(ge=1, le=1024)] = 8
    max_connections: Annotated[int, Field(ge=1, le=65536)] = 1024
    # "host:port" (IPv6 as "[::1]:9464") serving GET /metrics over HTTP; off when unset.
    metrics_listen: str | None = None
    # What one peer may hold, so that no peer (or uid) can keep the others out; each limit a
    # peer hits is a `busy` reply naming it. Connections:
    max_connections_per_uid: Annotated[int, Field(ge=1, le=65536)] = 512
    hello_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0  # a new connection must say hello by then
    idle_timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] = 600.0  # closed if silent, no leases
    frame_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0  # a request must arrive whole by then
    # Bytes buffered for peers (requests being received, replies not yet read), all and per uid;
    # past a limit the connection holding the most is cut off:
    max_buffer_bytes: BufferBytes = 1 << 30
    max_buffer_bytes_per_uid: BufferBytes = 256 * MIB
    # Descriptors: sent but not yet read by the client, per connection; a uid's connections and
    # unread descriptors together; entries (each holds an arena descriptor).
    max_fds_per_connection: Annotated[int, Field(ge=1, le=4096)] = 64
    max_fds_per_uid: Annotated[int, Field(ge=2, le=1 << 20)] = 4096
    max_entries: Annotated[int, Field(ge=1, le=1 << 20)] = 4096
    # Generations of a series kept, besides the current one, for rollback (and to readers still on them).
    keep_generations: Annotated[int, Field(ge=0, le=64)] = 1
    max_watches_per_connection: Annotated[int, Field(ge=1, le=4096)] = 64
    # Entries one uid may publish (a full daemon evicts its least recently used unleased entry).
    max_entries_per_uid: Annotated[int, Field(ge=1, le=1 << 20)] = 256
    # Leases one uid holds (read and fill, over all its connections).
    max_leases_per_uid: Annotated[int, Field(ge=1, le=1 << 20)] = 4096

    @field_validator("budget")
    @classmethod
    def _sizes(cls, v: dict[str, int | str]) -> dict[str, int | str]:
        for device, size in v.items():
            try:
                check_device(device)
                parse_size(size)
            except ValueError as e:
                raise ValueError(f"{device}: {e}") from None
        return v

    @field_validator("metrics_listen")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)
        return v

    def metrics_address(self) -> tuple[str, int] | None:
        return None if self.metrics_listen is None else parse_host_port(self.metrics_listen)

    @field_validator("allowed_groups", "admin_groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        try:
            group_gids(v)
        except KeyError as e:
            raise ValueError(f"group {e.args[0]!r} does not exist on this host") from None
        return v

    def allowed_gids(self) -> set[int]:
        return group_gids(self.allowed_groups)

    def is_admin(self, uid: int, gids: Collection[int], daemon_uid: int) -> bool:
        """Whether a peer with `uid` in groups `gids` is an admin of a daemon running as `daemon_uid`."""
        if uid in (0, daemon_uid) or uid in self.admin_uids:
            return True
        return bool(self.admin_groups) and not group_gids(self.admin_groups).isdisjoint(gids)


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=_NAME)]
    path: Path
    device: str = HOST_DEVICE
    retention: Retention = "pinned"
    # Shards that are symbolic links are followed only while they stay inside `path` (openat2
    # RESOLVE_BENEATH); true follows them anywhere (a Hugging Face cache's snapshots/ -> blobs/).
    follow_symlinks: bool = False

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("path")
    @classmethod
    def _exists(cls, v: Path, info: ValidationInfo) -> Path:
        # After a restart with weights kept in systemd's fd store, a checkpoint may be gone on
        # purpose: the daemon then serves the kept copy (check_paths=False).
        if not v.exists() and (info.context or {}).get("check_paths", True):
            raise ValueError(f"{v} does not exist")
        return v.resolve()


class FleetConfig(BaseModel):
    """`[fleet]` (DESIGN §12): fill entries from peer daemons over NIXL; off when the section is
    absent, and then nothing of `wcd.fleet` is imported. Peers prove the shared secret on the
    control channel; what this daemon serves is only what `offer` names."""

    model_config = ConfigDict(extra="forbid")

    listen: str  # "host:port" of the control channel (TCP) peers connect to
    # The shared secret (at least 32 bytes): owned by the daemon's uid, readable by nobody else.
    secret_file: Path
    peers: Annotated[list[str], Field(max_length=64)] = []  # "host:port" of other daemons, asked in order
    # Devices whose entries are served, each with the most bytes exported to peers at once.
    offer: dict[str, Size] = {}
    offer_published: bool = False  # published entries too (their publisher's bytes), not only loads
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    # One fill from one peer must end by then: a cut link can leave a transfer hanging.
    fetch_timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 600.0
    max_connections: Annotated[int, Field(ge=1, le=65536)] = 256  # control connections from peers at once
    # UCX_* environment of the transfer helpers, e.g. {UCX_TLS = "tcp", UCX_NET_DEVICES = "eth1"}.
    ucx: dict[str, str] = {}

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        parse_host_port(v)
        return v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        for peer in v:
            parse_host_port(peer)
        return v

    @field_validator("offer")
    @classmethod
    def _offer(cls, v: dict[str, int | str]) -> dict[str, int | str]:
        for device, size in v.items():
            try:
                check_device(device)
                if parse_size(size) <= 0:
                    raise ValueError("must be more than 0 bytes")
            except ValueError as e:
                raise ValueError(f"{device}: {e}") from None
        return v

    @field_validator("ucx")
    @classmethod
    def _ucx(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not re.fullmatch(r"UCX_[A-Z0-9_]{1,64}", name):
                raise ValueError(f"{name!r}: only UCX_* variables (upper case) belong here")
        return v

    def offered_bytes(self, device: str) -> int:
        """The most bytes of `device` exported at once; 0 if it is not offered."""
        size = self.offer.get(device)
        return 0 if size is None else parse_size(size)

    def read_secret(self, daemon_uid: int) -> bytes:
        """The shared secret; `ConfigError` if its file is missing, short, or open to others."""
        where = f"fleet.secret_file {self.secret_file}"
        try:
            fd = os.open(self.secret_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"{where}: cannot open it ({e.strerror}); write a random secret of 32 bytes "
                              "or more there, mode 0600") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != daemon_uid or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{where}: must be a file owned by uid {daemon_uid} that no one else may read "
                                  f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
            secret = os.read(fd, 4096).strip()
        finally:
            os.close(fd)
        if len(secret) < 32:
            raise ConfigError(f"{where}: holds {len(secret)} bytes; a shared secret needs 32 or more "
                              "(e.g. `head -c 48 /dev/urandom | base64`)")
        return secret


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    daemon: DaemonConfig = DaemonConfig()
    models: list[ModelConfig] = []
    fleet: FleetConfig | None = None

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique; repeated: {', '.join(sorted(dup))}")
        return models


def load_config(path: Path, instance: str | None = None, check_paths: bool = True,
                data: dict[str, Any] | None = None) -> Config:
    """Read and validate a TOML config (`data`: the file's TOML, already read by
    `wcd.configfile.read_toml`). Raises `ConfigError` with one line naming the problem."""
    if data is None:
        data = read_toml(path)
    # With a fleet, a configured checkpoint missing here may be filled from a peer that holds it.
    check_paths = check_paths and "fleet" not in data
    try:
        config = Config.model_validate(data, context={"check_paths": check_paths})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "top level"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        raise ConfigError(f"config {path}: {where}: {msg}") from None
    if config.daemon.socket is None:
        config.daemon.socket = RUN_DIR / f"{instance or 'wcd'}.sock"
    return config
