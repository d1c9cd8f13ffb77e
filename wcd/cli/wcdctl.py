"""`wcdctl`: inspect and steer a running daemon. Parsing and printing only.

Exit codes: 0 ok, 1 the daemon replied with an error, 2 usage, 3 daemon unreachable, 4 (`status`)
a configured model failed to load. The daemon
is `--socket PATH`, else `--instance NAME` (`$WCD_RUN_DIR/NAME.sock`, /run/wcd by default), else
`$WCD_SOCKET`, else the only socket in the run directory. Every
failure is one line on stderr; `--json` prints exactly one JSON document on stdout. A reader
that closes the pipe early (`wcdctl list | head -1`) ends the command quietly, with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from wcd import __version__
from wcd.cli import Parser, die, quiet_on_closed_pipe
from wcd.client import Client
from wcd.configfile import RUN_DIR, instance_socket_path, instance_sockets
from wcd.errors import DaemonUnavailable, PermissionDenied, WcdError
from wcd.units import counted, describe_progress, format_duration, format_size

PROG = "wcdctl"
EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_FAILED = 1, 2, 3, 4


def _parser() -> argparse.ArgumentParser:
    # Global options go before or after the subcommand (`wcdctl --json list`, `wcdctl list
    # --json`), as with systemctl: every subparser shares them. SUPPRESS keeps a subparser that
    # did not see an option from overwriting what the main parser read (defaults are applied after
    # parsing: set_defaults would change the shared option objects, and with them the subparsers).
    common = Parser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument("--socket", default=argparse.SUPPRESS,
                       help="daemon socket (default: $WCD_SOCKET, or the only socket in the run directory)")
    where.add_argument("-i", "--instance", default=argparse.SUPPRESS, metavar="NAME",
                       help=f"the daemon of instance NAME: {RUN_DIR}/NAME.sock")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    parser = Parser(prog=PROG, description="Inspect and control a wcd daemon", parents=[common])
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd, text in (("status", "daemon, devices, entries and loads in progress"), ("list", "resident entries"),
                      ("leases", "live leases"), ("ping", "round-trip time"), ("metrics", "Prometheus metrics")):
        sub.add_parser(cmd, help=text, parents=[common])
    load = sub.add_parser("load", help="load a configured model, or a checkpoint path (root/daemon user)",
                          parents=[common])
    load.add_argument("name")
    load.add_argument("path", nargs="?")
    load.add_argument("--device")
    load.add_argument("--retention", choices=["pinned", "cached", "ephemeral"])
    load.add_argument("--wait", action="store_true", help="return when the load is done")
    for cmd, text in (("evict", "drop an entry (after its leases end)"),
                      ("verify", "recompute an entry's content digest and compare")):
        sub.add_parser(cmd, help=text, parents=[common]).add_argument("name")
    rollback = sub.add_parser("rollback", help="make the previous generation of a series current again "
                              "(its publisher or an admin)", parents=[common])
    rollback.add_argument("series")
    rollback.add_argument("--to", type=int, metavar="N", help="that kept generation rather than the newest")
    return parser


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.socket = _socket(getattr(args, "socket", None), getattr(args, "instance", None))
    args.json = getattr(args, "json", False)
    try:
        with Client(args.socket, name=f"wcdctl pid {os.getpid()}", timeout=None if args.command in
                    ("load", "verify") else 30, heartbeats=False) as client:
            result = _run(client, args)
    except DaemonUnavailable as e:
        die(PROG, e.message, EXIT_UNREACHABLE)
    except PermissionDenied as e:
        die(PROG, e.message, EXIT_UNREACHABLE if e.details.get("stage") == "connect" else EXIT_ERROR)
    except WcdError as e:
        die(PROG, f"{e.message} [{e.code}]", EXIT_ERROR)
    except KeyboardInterrupt:
        if args.command == "load" and args.wait:
            die(PROG, f"interrupted: the load of {args.name} goes on in the daemon (wcdctl status shows it; "
                f"wcdctl evict {args.name} stops it)", 130)
        die(PROG, "interrupted", 130)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(_render(args.command, result))
    if args.command == "verify" and not result.get("match"):
        return EXIT_ERROR
    if args.command == "status" and any(e["state"] == "failed" and e["origin"] == "config" for e in result["entries"]):
        return EXIT_FAILED
    return 0


def _socket(given: str | None, instance: str | None) -> str:
    """The daemon to talk to (see the module's docstring); one line and an exit if none or several."""
    if given:
        return given
    if instance:
        return str(instance_socket_path(instance))
    if os.environ.get("WCD_SOCKET"):
        return os.environ["WCD_SOCKET"]
    found = instance_sockets()
    if len(found) == 1:
        return str(found[0])
    if not found:
        die(PROG, f"no daemon socket in {RUN_DIR} (is wcd@NAME.socket started?): pass --instance NAME or "
            "--socket PATH, or set WCD_SOCKET", EXIT_UNREACHABLE)
    names = ", ".join(p.name.removesuffix(".sock") for p in found)
    die(PROG, f"{len(found)} daemons in {RUN_DIR} ({names}): pick one with --instance NAME", EXIT_USAGE)


def _run(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    cmd = args.command
    if cmd == "status":
        return _strip(client.status())
    if cmd == "list":
        return {"entries": client.list()}
    if cmd == "leases":
        return {"leases": client.list_leases()}
    if cmd == "ping":
        n, started = 10, time.perf_counter()
        for _ in range(n):
            client.ping()
        return {"rtt_us": round((time.perf_counter() - started) / n * 1e6, 1), "server": client.server["server"]}
    if cmd == "metrics":
        text = client.metrics()
        return {"text": text} if not args.json else {"metrics": _samples(text)}
    if cmd == "load":
        # A bar only for a person watching: nothing extra on a pipe, in a file or with --json.
        shown = args.wait and not args.json and sys.stdout.isatty() and sys.stderr.isatty()
        entry = client.load(args.name, args.path, device=args.device, retention=args.retention,
                            wait=args.wait and not shown)
        return {"entry": _watch(client, entry) if shown and entry["state"] == "loading" else entry}
    if cmd == "evict":
        return _strip(client.evict(args.name))
    if cmd == "rollback":
        return _strip(client.rollback(args.series, args.to))
    return _strip(client.verify(args.name))


WATCH_EVERY_S = 0.25  # how often `load --wait` on a terminal asks how far the load got


def _watch(client: Client, entry: dict[str, Any]) -> dict[str, Any]:
    """Follow a load in the daemon with a progress bar on stderr (phase, bytes, rate, time left)
    until it is ready; a load that fails or goes away raises, as `load --wait` would."""
    from tqdm import tqdm

    from wcd.errors import LoadFailed, NotFound

    name = entry["name"]
    # The terminal's size, or 80x24 where it says 0x0 (a pty nobody sized): tqdm would draw nothing.
    size = shutil.get_terminal_size()
    with tqdm(total=entry["progress"]["total"], unit="B", unit_scale=True, unit_divisor=1024, ncols=size.columns,
              nrows=size.lines,
              desc=f"{name}: {entry['progress'].get('phase') or 'loading'}") as bar:
        while entry["state"] in ("loading", "evicting"):
            time.sleep(WATCH_EVERY_S)
            entry = next((e for e in client.list() if e["name"] == name), {"state": "gone"})
            if entry["state"] == "failed":
                raise LoadFailed(entry["reason"], {"name": name})
            if entry["state"] == "gone":
                raise NotFound(f"{name} went away while loading (evicted?): wcdctl status shows what is there")
            progress = entry["progress"]
            bar.set_description(f"{name}: {progress.get('phase') or entry['state']}", refresh=False)
            bar.update(progress["done"] - bar.n)
    return entry


def _samples(text: str) -> list[dict[str, Any]]:
    """The metrics as JSON: one object per family, with its samples (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [{"name": f.name, "type": f.type, "help": f.documentation,
             "samples": [{"name": x.name, "labels": x.labels, "value": x.value} for x in f.samples]}
            for f in text_string_to_metric_families(text)]


def _strip(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in ("id", "ok")}


# -- human-readable output --------------------------------------------------------------------


def _render(cmd: str, r: dict[str, Any]) -> str:
    if cmd == "status":
        return _status(r)
    if cmd == "list":
        return _entries(r["entries"])
    if cmd == "leases":
        rows = [[str(x["id"]), x["entry"], x["kind"], str(x["pid"]), str(x["uid"]),
                 f"{x['expires_in_s']:.1f}s" if x["expires_in_s"] is not None else "held by wcd"]
                for x in r["leases"]]
        return _table(["LEASE", "ENTRY", "KIND", "PID", "UID", "EXPIRES IN"], rows) if rows else "no leases"
    if cmd == "ping":
        return f"{r['server']}: {r['rtt_us']} µs round trip"
    if cmd == "metrics":
        return str(r["text"]).rstrip("\n")
    if cmd == "load":
        e = r["entry"]
        return f"{e['name']}: {e['state']} ({format_size(e['bytes'])}, {e['tensors']} tensors on {e['device']})"
    if cmd == "rollback":
        return (f"{r['series']}: generation {r['generation']} is current again ({r['entry']}; "
                f"{counted(r['told'], 'follower')} told)")
    if cmd == "evict":
        if r["state"] == "evicted":
            return f"{r['entry']}: evicted"
        return f"{r['entry']}: {r['state']}; freed when its {counted(r['leases'], 'lease')} end"
    listed = r["mismatched"]
    count = r.get("mismatched_count", len(listed))  # older daemons sent the names only (50 at most)
    verdict = "OK" if r["match"] else f"MISMATCH in {count} tensor(s): {', '.join(listed)}" + \
        (f" and {count - len(listed)} more" if count > len(listed) else "")
    return f"{r['entry']}: {verdict} ({r['tensors']} tensors against {r['against']}; digest {r['digest']})"


def _status(r: dict[str, Any]) -> str:
    failures = sum(e["state"] == "failed" for e in r["entries"])
    failed = f"{failures} failed, " if failures else ""
    lines = [f"wcd {r['version']}  instance {r['instance']}  pid {r['pid']}  "
             f"up {format_duration(r['uptime_s'])}  {r['socket']}",
             f"{counted(sum(e['state'] != 'failed' for e in r['entries']), 'entry')}, "
             f"{failed}{counted(r['leases'], 'lease')}, "
             f"{counted(r['connections'], 'connection')}, "
             f"lease TTL {r['lease_ttl_s']:g}s", ""]
    lines.append(_table(["DEVICE", "NAME", "TOTAL", "FREE", "BUDGET", "USED BY WCD"], [
        [d["device"], d["name"], format_size(d["total"]), format_size(d["free"]), format_size(d["budget"]),
         format_size(d["used"])]
        for d in r["devices"]]))
    lines += ["", _entries(r["entries"])]
    return "\n".join(lines)


def _entries(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no entries"
    rows = []
    for e in entries:
        state = e["state"]
        p = e["progress"]
        if state == "loading" and p["total"]:
            state += " " + describe_progress(p)
        rows.append([e["name"], state, e["device"], format_size(e["bytes"]), str(e["tensors"]), str(e["leases"]),
                     e["retention"] or "-", e["origin"], format_duration(e["idle_s"])])
    table = _table(["ENTRY", "STATE", "DEVICE", "SIZE", "TENSORS", "LEASES", "RETENTION", "ORIGIN", "IDLE"], rows)
    notes = [f"  {e['name']}: {note}" for e in entries for note in e.get("notes", [])]
    notes += [f"  {e['name']}: loaded again; the copy before went at {e['previous']}" for e in entries
              if e.get("previous")]
    return "\n".join([table, *notes])


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


if __name__ == "__main__":
    sys.exit(main())
