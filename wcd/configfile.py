"""The config file before validation: where an instance's file lives, reading its TOML with
one-line errors, and the devices it names.

No pydantic here: `wcd serve` reads the file first, starts loading the CUDA driver if the file
names a GPU (`wcd.arenas.start_driver`), and only then imports the schemas (`wcd.config`), which
are about two thirds of the daemon's start-up. `wcd.config.load_config` reads files through here.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

from wcd.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path("/etc/wcd")
# Where instances put their sockets (`/run/wcd/NAME.sock`, as the units do); WCD_RUN_DIR moves it
# for the daemon and wcdctl alike (a user's own daemons, tests).
RUN_DIR = Path(os.environ.get("WCD_RUN_DIR") or "/run/wcd")


def instance_config_path(instance: str) -> Path:
    return CONFIG_DIR / f"{instance}.toml"


def instance_socket_path(instance: str) -> Path:
    return RUN_DIR / f"{instance}.sock"


def instance_sockets() -> list[Path]:
    """The sockets in RUN_DIR, sorted: the instances that may be running."""
    try:
        with os.scandir(RUN_DIR) as it:
            found = [Path(e.path) for e in it if e.name.endswith(".sock") and _is_socket(e)]
    except OSError:  # no such directory, or not ours to read
        return []
    return sorted(found)


def _is_socket(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return False


def read_toml(path: Path) -> dict[str, Any]:
    """The file's TOML as a table. Raises `ConfigError` with one line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config {path}: file not found") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path}: not valid TOML (not UTF-8 text)") from None
    except OSError as e:
        raise ConfigError(f"config {path}: cannot read ({e.strerror})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: not valid TOML ({e})") from None


def named_devices(data: dict[str, Any]) -> list[str]:
    """The devices an unvalidated config names: each model's `device` and the `[daemon.budget]`
    keys, the same places `wcd.devices.device_budgets` looks. Whatever is malformed is skipped:
    validation reports it."""
    models = data.get("models")
    daemon = data.get("daemon")
    budget = daemon.get("budget") if isinstance(daemon, dict) else None
    named = [m.get("device") for m in models if isinstance(m, dict)] if isinstance(models, list) else []
    named += list(budget) if isinstance(budget, dict) else []
    return [d for d in named if isinstance(d, str)]
