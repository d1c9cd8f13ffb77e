"""The files in systemd/: `systemd-analyze verify` finds nothing to say, `systemd-analyze security`
rates the service safe, sysusers + tmpfiles build the /run/wcd the socket expects, and the
units agree with each other, with wcd.systemd and with the daemon's needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from wcd import systemd
from wcd.cli.wcd import USAGE_ERROR
from wcd.config import load_config

UNITS = Path(__file__).resolve().parents[2] / "systemd"
BINARY = "/usr/bin/wcd"
MAX_EXPOSURE = 4.0

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def config_lines(path: Path) -> list[list[str]]:
    """The fields of each line of a sysusers.d / tmpfiles.d file (none of ours has quoted spaces
    before the fields we check)."""
    return [line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) in order; unit files repeat keys, so no dict per section."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= appears {len(found)} times"
    return found[0]


SERVICE = parse_unit(UNITS / "wcd@.service")
SOCKET = parse_unit(UNITS / "wcd@.socket")


def installed_units(tmp_path: Path) -> Path:
    """The units as installed, but with ExecStart= on a stand-in binary: verify insists that it
    exists, and nothing else may differ from the shipped files."""
    binary = tmp_path / "wcd"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    service = (UNITS / "wcd@.service").read_text()
    assert service.count(f"ExecStart={BINARY} ") == 1
    (units / "wcd@.service").write_text(service.replace(f"ExecStart={BINARY} ", f"ExecStart={binary} "))
    shutil.copy(UNITS / "wcd@.socket", units)
    return units


@needs_analyze
def test_verify_is_clean(tmp_path: Path) -> None:
    units = installed_units(tmp_path)
    # Instance paths resolve to the templates beside them, as /etc/systemd/system would.
    result = subprocess.run(
        ["systemd-analyze", "verify", str(units / "wcd@test.service"), str(units / "wcd@test.socket")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


@needs_analyze
def test_verify_would_catch_a_mistake(tmp_path: Path) -> None:
    units = installed_units(tmp_path)
    with open(units / "wcd@.socket", "a") as f:
        f.write("[Socket]\nListenStrem=/run/wcd/typo.sock\n")
    result = subprocess.run(
        ["systemd-analyze", "verify", str(units / "wcd@test.service"), str(units / "wcd@test.socket")],
        capture_output=True, text=True,
    )
    assert "Unknown key 'ListenStrem'" in result.stdout + result.stderr


@needs_analyze
def test_service_exposure_is_low(tmp_path: Path) -> None:
    units = installed_units(tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(units / "wcd@test.service")],
        capture_output=True, text=True,
    )
    out = result.stdout + result.stderr
    match = re.search(r"Overall exposure level for wcd@test\.service: (\d+(?:\.\d+)?)", out)
    assert match, out
    assert float(match.group(1)) <= MAX_EXPOSURE, out


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="systemd-sysusers / systemd-tmpfiles not installed",
)
def test_sysusers_and_tmpfiles_make_the_run_directory(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()  # sysusers writes passwd/group here; tmpfiles resolves wcd from them
    root = f"--root={tmp_path}"
    subprocess.run(["systemd-sysusers", root, str(UNITS / "wcd.sysusers")], check=True, capture_output=True)
    subprocess.run(["systemd-tmpfiles", "--create", root, str(UNITS / "wcd.tmpfiles")], check=True, capture_output=True)
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    group = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()}
    user = passwd["wcd"]
    assert user[3] == group["wcd"][2]  # primary group wcd
    assert int(user[2]) < 1000 and user[6].endswith("nologin")  # a system user without a login
    run = os.stat(tmp_path / "run/wcd")
    assert (oct(run.st_mode & 0o7777), run.st_uid, run.st_gid) == ("0o750", 0, int(group["wcd"][2]))


def test_units_agree_with_each_other() -> None:
    (kind, path, mode, owner, group_name, _), = config_lines(UNITS / "wcd.tmpfiles")
    assert [line[:2] for line in config_lines(UNITS / "wcd.sysusers")] == [["u", "wcd"]]

    assert (kind, owner, group_name) == ("d", "root", "wcd")
    assert os.path.dirname(value(SOCKET, "Socket", "ListenStream")) == path
    assert value(SOCKET, "Socket", "DirectoryMode") == mode
    assert value(SOCKET, "Socket", "SocketGroup") == group_name
    assert value(SOCKET, "Socket", "SocketMode") == "0660"
    assert value(SOCKET, "Socket", "FileDescriptorName") == systemd.SOCKET_NAME

    assert value(SERVICE, "Service", "User") == value(SERVICE, "Service", "Group") == "wcd"
    assert value(SERVICE, "Unit", "Requires") == value(SERVICE, "Unit", "After") == "wcd@%i.socket"
    assert value(SERVICE, "Service", "ExecStart") == f"{BINARY} serve --instance %i"


def test_service_keeps_what_the_daemon_needs() -> None:
    assert value(SERVICE, "Service", "Type") == "notify"  # READY=1 / RELOADING=1 / STOPPING=1
    assert value(SERVICE, "Service", "WatchdogSec") == "30s"
    # A bad config exits 2 (one line in the journal): restarting it would only repeat that line.
    assert value(SERVICE, "Service", "Restart") == "on-failure"
    assert value(SERVICE, "Service", "RestartPreventExitStatus") == str(USAGE_ERROR)
    assert int(value(SERVICE, "Service", "FileDescriptorStoreMax")) >= 2  # arena fd + manifest memfd
    # /dev/nvidia* must stay reachable, CUDA maps W+X code, SO_PEERCRED must see real uids, and a
    # RuntimeDirectory= would delete /run/wcd (and the socket) whenever the service stops.
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "PrivateUsers", "RuntimeDirectory", "ProcSubset"):
        assert not values(SERVICE, "Service", key), f"{key}= breaks the daemon"
    assert value(SERVICE, "Service", "DevicePolicy") == "closed"
    allowed = {v.split()[0] for v in values(SERVICE, "Service", "DeviceAllow")}
    assert {"char-nvidia", "char-nvidiactl", "char-nvidia-uvm"} <= allowed
    assert value(SERVICE, "Service", "ProtectHome") == "read-only"  # models may live in /home


def test_example_config_is_valid(tmp_path: Path) -> None:
    """The example passes the daemon's own validation once its model path exists."""
    example = (UNITS / "example.toml").read_text()
    checkpoint = tmp_path / "llama-70b"
    checkpoint.mkdir()
    assert example.count('path = "/models/llama-70b"') == 1
    (tmp_path / "llama70b.toml").write_text(example.replace("/models/llama-70b", str(checkpoint)))
    config = load_config(tmp_path / "llama70b.toml", "llama70b")
    assert config.daemon.socket == Path("/run/wcd/llama70b.sock")
    assert [(m.name, m.path, m.retention) for m in config.models] == [("llama70b", checkpoint, "pinned")]
