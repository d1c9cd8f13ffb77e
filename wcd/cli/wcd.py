"""`wcd serve` (the daemon) and `wcd demo` (the embedded default)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

from wcd import __version__
from wcd.cli import Parser, die, quiet_on_closed_pipe
from wcd.errors import WcdError

USAGE_ERROR = 2


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="wcd", description="GPU weight cache daemon")
    parser.add_argument("--version", action="version", version=f"wcd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", type=Path, help="TOML config file")
    where.add_argument("--instance", help="instance name: reads /etc/wcd/NAME.toml, listens on /run/wcd/NAME.sock")
    serve.add_argument("--socket", type=Path, help="listen here (overrides the config)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    demo_help = ("write a checkpoint (~330 MiB by default) to a temporary directory under $TMPDIR, serve it, "
                 "attach it, compare with safetensors; all removed at the end")
    demo = sub.add_parser("demo", help=demo_help, description=demo_help)
    demo.add_argument("--size-mb", type=int, default=384, metavar="MB",
                      help="checkpoint size to aim at, in MiB; the layout writes ~85%% of it (default 384: ~330 MiB)")
    demo.add_argument("--tensors", type=int, default=300, help="number of tensors (default 300)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_main(args)
    try:
        import numpy  # noqa: F401 - safetensors.torch writes through it
        import torch  # noqa: F401
    except ImportError as e:
        die("wcd demo", f"needs {e.name or 'torch'} on the engine side: pip install 'wcd-weight-cache[torch]', "
            "or '.[torch]' in a checkout (the daemon itself does not)", 1)
    from wcd.demo import run_demo

    try:
        return run_demo(args.size_mb, args.tensors)
    except WcdError as e:
        die("wcd demo", e.message, 1)


def _open_stdio() -> None:
    """Put /dev/null on whichever of fds 0-2 is closed (`wcd serve 2>&-`). Otherwise the first
    descriptor the daemon opens lands there: a C library's message to stderr would go to it, and
    libuv aborts the daemon when it closes it (it asserts that it never closes 0-2)."""
    for fd in (0, 1, 2):  # in order: those below are open, so the lowest free descriptor is this one
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)


def serve_main(args: argparse.Namespace) -> int:
    _open_stdio()
    from wcd import systemd
    from wcd.arenas import start_driver
    from wcd.configfile import instance_config_path, named_devices, read_toml
    from wcd.gcpause import gc_paused
    from wcd.logsink import LogWriter

    # A journal that stops reading must not stall the loop, and every client with it (wcd.logsink).
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(message)s",
                        handlers=[LogWriter(2)])
    path = args.config or instance_config_path(args.instance)
    # pydantic's documented switch: it would otherwise list every installed distribution's entry
    # points at its first schema for plugins (4 ms on the VM; 12-18 ms on the H200 host, 214 of them),
    # which would then run inside the daemon at each validation. The daemon wants none.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    try:
        # Importing the server and validating the config build ~50,000 objects that live as long
        # as the daemon (modules, classes, schemas) and next to no garbage: with the collector on,
        # ~70 collections walked them on the way (6-8% of start-up). Paused meanwhile, then frozen,
        # so that no collection after READY walks them either (the first would hold the loop ~20 ms).
        with gc_paused():
            data = read_toml(path)
            # The CUDA driver loads while the config's schemas and the server import (most of start-up).
            start_driver(named_devices(data))
            from wcd.config import load_config
            from wcd.server import run

            passed = systemd.listen_fds()
            # After a restart with weights parked in systemd's fd store, a configured checkpoint may
            # be gone on purpose: the daemon serves the kept copy and flags it in status.
            restarted = bool(systemd.split_listener(passed)[1])
            config = load_config(path, args.instance, check_paths=not restarted, data=data)
        gc.freeze()
        if args.socket is not None:
            config.daemon.socket = args.socket
        return run(config, args.instance or path.stem, path, passed)
    except WcdError as e:
        die("wcd", e.message, USAGE_ERROR if e.code == "config_error" else 1)
    except systemd.SystemdError as e:
        die("wcd", str(e), 1)
    except PermissionError as e:
        die("wcd", f"{e.filename}: permission denied (run as the wcd user or root, or pick another --socket)", 1)


if __name__ == "__main__":
    sys.exit(main())
