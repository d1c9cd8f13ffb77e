"""The real units and the real daemon under a real systemd (252, Debian 12) in a container.

One container is booted for the module; the tests run in order and build on each other, like an
operator's session (run the module, not a single test): socket activation and a bit-identical
attach, the STATUS line, a restart that keeps the weights in systemd's fd store with the
checkpoint moved away, a watchdog kill of a hung daemon (the fd store survives it too), a reload
that loads a model added to the config (with the kept checkpoint back, then still missing), and
a stop that empties the fd store.

Inside the container there is no torch: checker.py attaches through wcd.client's low-level
request and compares every tensor's bytes with the checkpoint file's data, stdlib only.
Needs root; skipped otherwise, or when systemd-nspawn/debootstrap are missing and cannot be
installed. The first run builds a cached Debian rootfs (~1 min); later runs boot in seconds.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from tests.system import nspawn

pytestmark = pytest.mark.system

SERVICE, SOCKET = "wcd@demo.service", "wcd@demo.socket"
SOCK = "/run/wcd/demo.sock"
MODELS = "/var/lib/wcd-models"
DEMO, MOVED = f"{MODELS}/demo", "/root/demo-moved-away"
EXTRA = f"{MODELS}/extra.safetensors"
CONFIG = "/etc/wcd/demo.toml"
DEMO_CONFIG = f"""\
[daemon]
lease_ttl_s = 30
allowed_uids = [0]
budget = {{ cpu = "1GiB" }}

[[models]]
name = "demo"
path = "{DEMO}"
retention = "pinned"
"""
# wcd and its dependencies as the launchers in /usr/bin find them (setup-container.sh).
CHECKER = "PYTHONPATH=/opt/wcd/lib:/usr/lib/wcd python3 /opt/wcd/checker.py"
T = TypeVar("T")


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nspawn.Container]:
    try:
        nspawn.ensure_host_tools()
        root = nspawn.rootfs()
        site = nspawn.site(root)
    except nspawn.Unavailable as e:
        pytest.skip(str(e))
    work = tmp_path_factory.mktemp("nspawn")
    staged = nspawn.stage(work / "stage", nspawn.container_python(root))
    container = nspawn.Container(root, [(staged, "/opt/wcd"), (site, "/usr/lib/wcd")], work)
    try:
        container.boot()
        container.run("sh /opt/wcd/setup-container.sh", timeout=60)
        yield container
    finally:
        container.stop()


def wait_for(what: str, probe: Callable[[], T], timeout: float = 30, interval: float = 0.2) -> T:
    """probe()'s first truthy result; fails with `what` and the last result after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last: {result!r}")
        time.sleep(interval)


def check(box: nspawn.Container, name: str, checkpoint: str, sock: str = SOCK) -> dict:
    """Attach `name` and compare every tensor with `checkpoint` (checker.py exits 1 on a difference)."""
    return json.loads(box.out(f"{CHECKER} check {sock} {name} {checkpoint}", timeout=60))


def status(box: nspawn.Container) -> dict:
    return json.loads(box.out(f"wcdctl --socket {SOCK} --json status", timeout=30))


def entry(box: nspawn.Container, name: str) -> dict | None:
    return next((e for e in status(box)["entries"] if e["name"] == name), None)


def journal(box: nspawn.Container, *match: str) -> str:
    return box.out(f"journalctl -b --no-pager -o cat {' '.join(match)}")


def main_pid(box: nspawn.Container) -> int:
    return int(box.show(SERVICE, "MainPID"))


def fd_store(box: nspawn.Container) -> int:
    return int(box.show(SERVICE, "NFileDescriptorStore"))


def test_socket_activation_attach_is_bit_identical(box):
    made = json.loads(box.out(f"{CHECKER} make {DEMO} --seed 1 --shards 3"))
    box.write(CONFIG, DEMO_CONFIG)
    box.run(f"systemctl start {SOCKET}")
    assert box.show(SOCKET, "ActiveState") == "active"
    assert box.show(SERVICE, "ActiveState") == "inactive"  # nothing runs until a client connects
    assert box.out(f"stat -c '%A %U %G' {SOCK} /run/wcd") == "srw-rw---- root wcd\ndrwxr-x--- root wcd"
    verify = box.run(f"systemd-analyze verify {SOCKET} {SERVICE}")
    assert verify.stdout + verify.stderr == ""  # systemd 252 has nothing to say about the units

    got = check(box, "demo", DEMO)  # the first connection starts the service
    assert (got["tensors"], got["bytes"], got["digest"]) == (made["tensors"], made["bytes"], made["digest"])
    assert box.show(SERVICE, "ActiveState") == "active"
    assert box.out(f"ps -o user= -p {main_pid(box)}") == "wcd"
    [demo] = status(box)["entries"]
    assert demo["state"] == "ready" and demo["tensors"] == made["tensors"] and demo["notes"] == []


def test_status_line_in_systemctl_status(box):
    wait_for("STATUS= to report the served entry",
             lambda: box.show(SERVICE, "StatusText").startswith("serving 1 entry, 0 leases, "))
    shown = box.run(f"systemctl status --no-pager {SERVICE}").stdout
    assert 'Status: "serving 1 entry, 0 leases, ' in shown, shown


def test_restart_keeps_weights_in_the_fd_store(box):
    wait_for("the parked arena and record in the fd store", lambda: fd_store(box) >= 2)
    before = main_pid(box)
    box.run(f"mv {DEMO} {MOVED}")  # the restart must not need the checkpoint

    box.run(f"systemctl restart {SERVICE}", timeout=60)
    after = main_pid(box)
    assert after not in (0, before)
    assert check(box, "demo", MOVED)["tensors"] == 30  # every tensor bit-identical to the moved files
    demo = entry(box, "demo")
    assert demo is not None and demo["state"] == "ready", demo
    assert any(f"checkpoint {DEMO} is missing" in note for note in demo["notes"]), demo["notes"]
    assert fd_store(box) >= 2
    wait_for("the adoption in the journal",
             lambda: "adopted demo from systemd's fd store" in journal(box, f"_PID={after}"), timeout=10)
    assert "loading demo" not in journal(box, f"_PID={after}")  # no disk read


def test_watchdog_restarts_a_hung_daemon(box):
    # A short watchdog for this instance only (a runtime drop-in); no core file from the SIGABRT.
    box.write(f"/run/systemd/system/{SERVICE}.d/50-test-watchdog.conf", "[Service]\nWatchdogSec=3s\nLimitCORE=0\n")
    box.run(f"systemctl daemon-reload && systemctl reset-failed {SERVICE} && systemctl restart {SERVICE}", timeout=60)
    assert box.show(SERVICE, "WatchdogUSec") == "3s"
    hung, restarts = main_pid(box), int(box.show(SERVICE, "NRestarts"))
    assert "Watchdog timeout" not in journal(box, "-u", SERVICE)

    box.run(f"kill -STOP {hung}")  # the event loop (and everything else) stops: no WATCHDOG=1 pings
    wait_for("systemd's watchdog to restart the service",
             lambda: int(box.show(SERVICE, "NRestarts")) > restarts and box.show(SERVICE, "ActiveState") == "active"
             and main_pid(box) not in (0, hung), timeout=30)
    log = wait_for("the watchdog in the journal",
                   lambda: text if "Watchdog timeout" in (text := journal(box, "-u", SERVICE)) else None, timeout=10)
    assert f"Killing process {hung} (wcd) with signal SIGABRT" in log, log[-3000:]
    # The fd store survived the kill: the weights are back without their checkpoint.
    new = main_pid(box)
    wait_for("the adoption after the watchdog restart",
             lambda: "adopted demo from systemd's fd store" in journal(box, f"_PID={new}"), timeout=10)
    assert check(box, "demo", MOVED)["tensors"] == 30

    # Back to the unit's own WatchdogSec= (a running service keeps the timeout it started with).
    box.run(f"rm -r /run/systemd/system/{SERVICE}.d && systemctl daemon-reload && systemctl reset-failed {SERVICE} "
            f"&& systemctl restart {SERVICE}", timeout=60)
    assert box.show(SERVICE, "WatchdogUSec") == "30s" and fd_store(box) >= 2


def reload_adds(box: nspawn.Container, name: str, path: str, seed: int, config: str, demo_at: str) -> None:
    """Write `config` (which adds model `name` at `path`), reload, and check the model is served."""
    made = json.loads(box.out(f"{CHECKER} make {path} --seed {seed}"))
    pid = main_pid(box)
    box.write(CONFIG, config)
    box.run(f"systemctl reload {SERVICE}", timeout=60)

    def loaded_or_failed() -> str | None:
        text = box.show(SERVICE, "StatusText")
        if text.startswith("reload failed"):
            return text
        e = entry(box, name)
        return "loaded" if e is not None and e["state"] == "ready" else None

    assert wait_for(f"the reload to load {name}", loaded_or_failed) == "loaded"
    got = check(box, name, path)
    assert (got["tensors"], got["bytes"], got["digest"]) == (made["tensors"], made["bytes"], made["digest"])
    assert check(box, "demo", demo_at)["tensors"] == 30  # untouched by the reload
    assert main_pid(box) == pid  # reloaded in place, not restarted
    n = len(status(box)["entries"])
    wait_for(f"STATUS= to count {n} entries",
             lambda: box.show(SERVICE, "StatusText").startswith(f"serving {n} entries, "))
    assert f"reloaded {CONFIG}" in journal(box, f"_PID={pid}")


EXTRA_CONFIG = DEMO_CONFIG + f'\n[[models]]\nname = "extra"\npath = "{EXTRA}"\nretention = "cached"\n'
THIRD = f"{MODELS}/third"


def test_reload_loads_a_model_added_to_the_config(box):
    box.run(f"mv {MOVED} {DEMO}")  # demo's checkpoint is back in place (the next test reloads without it)
    reload_adds(box, "extra", EXTRA, 2, EXTRA_CONFIG, demo_at=DEMO)
    assert entry(box, "extra")["retention"] == "cached"


def test_reload_while_a_kept_checkpoint_is_missing(box):
    # demo is served from the copy systemd kept across a restart, its checkpoint gone (as in
    # test_restart_keeps_weights_in_the_fd_store): adding another model must still work.
    box.run(f"mv {DEMO} {MOVED}")
    reload_adds(box, "third", THIRD, 3, EXTRA_CONFIG + f'\n[[models]]\nname = "third"\npath = "{THIRD}"\n',
                demo_at=MOVED)


def test_stop_empties_the_fd_store(box):
    box.run(f"test -e {DEMO} || mv {MOVED} {DEMO}")
    box.run(f"systemctl stop {SERVICE}", timeout=60)
    assert box.show(SERVICE, "ActiveState") == "inactive" and fd_store(box) == 0  # the weights are gone
    assert box.show(SOCKET, "ActiveState") == "active"  # still listening: the next client starts it
    made = json.loads(box.out(f"{CHECKER} make /tmp/demo-again --seed 1 --shards 3"))  # same seed: same tensors
    got = check(box, "demo", DEMO)
    assert (got["tensors"], got["digest"]) == (made["tensors"], made["digest"])
    pid = main_pid(box)
    log = wait_for("the load from disk in the journal",
                   lambda: text if "loaded demo" in (text := journal(box, f"_PID={pid}")) else None, timeout=10)
    assert f"in 30 tensors from {DEMO} to cpu" in log and "adopted" not in log, log


def test_a_config_error_fails_once_with_its_reason_in_systemctl_status(box):
    """Exit status 2 (RestartPreventExitStatus=2): no restarts, no 'start request repeated too
    quickly', and the daemon's one line where the operator looks first."""
    unit = "wcd@broken.service"
    box.write("/etc/wcd/broken.toml", '[daemon]\nlease_ttl_s = "soon"\n')
    box.run(f"systemctl start {unit}", check=False, timeout=60)
    wait_for(f"{unit} to fail", lambda: box.show(unit, "ActiveState") == "failed")
    time.sleep(3)  # RestartSec=1s: a restart would have come by now
    assert (box.show(unit, "NRestarts"), box.show(unit, "Result"), box.show(unit, "ExecMainStatus")) == (
        "0", "exit-code", "2")
    line = "wcd: config /etc/wcd/broken.toml: daemon.lease_ttl_s: Input should be a valid number"
    shown = wait_for("the reason in systemctl status", lambda: (
        text if line in (text := box.run(f"systemctl status --no-pager -n 5 {unit}", check=False).stdout) else None),
        timeout=10)
    assert "Traceback" not in journal(box, "-u", unit) and "repeated too quickly" not in shown, shown
    box.run(f"systemctl stop wcd@broken.socket && systemctl reset-failed {unit}")


METRICS_FETCH = ("python3 -c 'import sys, urllib.request; "
                 "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' http://127.0.0.1:9464/metrics")


def test_metrics_over_http_with_the_drop_in_the_unit_documents(box):
    unit = "wcd@scraped.service"
    box.write("/etc/wcd/scraped.toml", '[daemon]\nallowed_uids = [0]\nmetrics_listen = "127.0.0.1:9464"\n')
    # As shipped, the sandbox refuses TCP: one line that points at the drop-in, and no restarts.
    box.run(f"systemctl start {unit}", check=False, timeout=60)
    wait_for(f"{unit} to fail", lambda: box.show(unit, "ActiveState") == "failed")
    assert box.show(unit, "NRestarts") == "0"
    assert "allow TCP with a drop-in (see the comments in wcd@.service)" in journal(box, "-u", unit)
    box.run(f"systemctl reset-failed {unit}")
    # The drop-in from wcd@.service's comments, as `systemctl edit wcd@scraped` would write it.
    service = box.out("cat /usr/lib/systemd/system/wcd@.service")
    start = service.index("#   [Service]")
    drop_in = "\n".join(line[4:] for line in service[start:].splitlines()[:4]) + "\n"
    assert drop_in.startswith("[Service]\nPrivateNetwork=no\n"), drop_in
    box.write(f"/etc/systemd/system/{unit}.d/override.conf", drop_in)
    box.run(f"systemctl daemon-reload && systemctl start {unit}", timeout=60)
    text = wait_for("a scrape of /metrics", lambda: box.run(METRICS_FETCH, check=False).stdout, timeout=20)
    assert 'wcd_device_budget_bytes{device="cpu"}' in text and "wcd_connections 0.0" in text
    box.run(f"systemctl stop {unit} wcd@scraped.socket", timeout=60)


MOE = f"{MODELS}/moe"


def test_header_helpers_run_in_the_units_sandbox_and_end_with_it(box):
    """A large header (8,000 tensors in 2 shards) goes to a helper process under the unit's
    sandbox (seccomp filter, no capabilities): it starts, parses, runs as wcd, ends at stop."""
    unit, sock = "wcd@moe.service", "/run/wcd/moe.sock"
    made = json.loads(box.out(f"{CHECKER} make {MOE} --seed 4 --shards 2 --tensors 8000", timeout=60))
    box.write("/etc/wcd/moe.toml", f'[daemon]\nallowed_uids = [0]\nheader_helpers = 1\nbudget = {{ cpu = "1GiB" }}\n'
                                   f'\n[[models]]\nname = "moe"\npath = "{MOE}"\n')
    box.run(f"systemctl start {unit}", timeout=60)
    pid = int(box.show(unit, "MainPID"))
    helpers = wait_for("a header helper under the unit", lambda: box.run(
        f"ps -o user=,args= --ppid {pid}", check=False).stdout.strip())
    assert helpers.split()[0] == "wcd" and "wcd.header_helpers" in helpers, helpers
    got = check(box, "moe", MOE, sock)
    assert (got["tensors"], got["bytes"], got["digest"]) == (made["tensors"], made["bytes"], made["digest"])
    box.run(f"wcdctl --socket {sock} load again {MOE} --wait", timeout=60)  # the helper is up by now
    got = check(box, "again", MOE, sock)
    assert (got["tensors"], got["digest"]) == (made["tensors"], made["digest"])
    log = journal(box, f"_PID={pid}")
    assert re.search(r"admitting again: 2 shards, headers read and fingerprinted in [0-9.]+ s \([12] by helpers\)",
                     log), log
    assert "header helper" not in log, log  # none failed or could not start
    box.run(f"systemctl stop {unit} wcd@moe.socket", timeout=60)
    assert box.run("pgrep -f 'wcd[.]header_helpers'", check=False).stdout == ""
