"""Daemon configuration: pydantic schema, TOML loading, byte sizes and fractions.

`load_config` turns any problem (missing file, bad TOML, wrong type, unknown key, missing model
path, unknown group) into one `ConfigError` line that names the field. Nothing here starts
anything or touches devices: fractions like "90%" are resolved later against device totals.
"""

from __future__ import annotations

import grp
import re
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, ValidationInfo, field_validator

from wcd.errors import ConfigError
from wcd.key import HOST_DEVICE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path("/etc/wcd")
RUN_DIR = Path("/run/wcd")
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


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
    """Bytes for people: "512 B", "3.4 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


Size = Annotated[StrictInt | str, Field(union_mode="left_to_right")]


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    socket: Path | None = None
    lease_ttl_s: Annotated[float, Field(gt=0.05, le=3600)] = 30.0
    allowed_uids: list[Annotated[int, Field(ge=0)]] = []
    allowed_groups: list[str] = []
    budget: dict[str, Size] = {}
    load_workers: Annotated[int, Field(ge=1, le=256)] | None = None
    max_connections: Annotated[int, Field(ge=1, le=65536)] = 1024

    @field_validator("budget")
    @classmethod
    def _sizes(cls, v: dict[str, int | str]) -> dict[str, int | str]:
        for device, size in v.items():
            try:
                parse_size(size)
            except ValueError as e:
                raise ValueError(f"{device}: {e}") from None
        return v

    @field_validator("allowed_groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        for name in v:
            try:
                grp.getgrnam(name)
            except KeyError:
                raise ValueError(f"group {name!r} does not exist on this host") from None
        return v

    def allowed_gids(self) -> set[int]:
        return {grp.getgrnam(name).gr_gid for name in self.allowed_groups}


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=_NAME)]
    path: Path
    device: str = HOST_DEVICE
    retention: Literal["pinned", "cached", "ephemeral"] = "pinned"
    # Shards that are symbolic links are followed only while they stay inside `path` (openat2
    # RESOLVE_BENEATH); true follows them anywhere (a Hugging Face cache's snapshots/ -> blobs/).
    follow_symlinks: bool = False

    @field_validator("path")
    @classmethod
    def _exists(cls, v: Path, info: ValidationInfo) -> Path:
        # After a restart with weights kept in systemd's fd store, a checkpoint may be gone on
        # purpose: the daemon then serves the kept copy (check_paths=False).
        if not v.exists() and (info.context or {}).get("check_paths", True):
            raise ValueError(f"{v} does not exist")
        return v.resolve()


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    daemon: DaemonConfig = DaemonConfig()
    models: list[ModelConfig] = []

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique; repeated: {', '.join(sorted(dup))}")
        return models


def instance_config_path(instance: str) -> Path:
    return CONFIG_DIR / f"{instance}.toml"


def load_config(path: Path, instance: str | None = None, check_paths: bool = True) -> Config:
    """Read and validate a TOML config. Raises `ConfigError` with one line naming the problem."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config {path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"config {path}: cannot read ({e.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: not valid TOML ({e})") from None
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
