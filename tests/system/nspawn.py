"""A real systemd in a container: host tools, a cached Debian root filesystem, wcd's dependencies
built for the container's python3, and a booted `systemd-nspawn --boot` container to run in.

Needs root. Follows /work/shared/recipes/real-systemd.md: `unshare --mount` with a tmpfs on
/run (so nspawn leaves nothing in the host's /run), `--register=no --keep-unit` (no host systemd
or D-Bus), `--volatile=overlay` (the cached rootfs stays pristine), a unified cgroup hierarchy,
`nsenter` to run commands inside, SIGTERM to the nspawn process to halt.

Caches live in ~/.cache/wcd (or $XDG_CACHE_HOME/wcd), next to the Makefile's venv:
  nspawn-rootfs-<key>  debootstrap --variant=minbase of Debian 12 (~50-90 s to build, ~200 MB),
                       keyed on the suite, architecture and packages included
  nspawn-site-<key>    `pip install --target` of pyproject.toml's dependencies (~30 MB), keyed on
                       them and the container's python and glibc
Each is built in a temporary directory and renamed into place, under a lock, so an interrupted
or concurrent build never leaves a half-made cache behind. Delete one to rebuild it (e.g. to
pick up a Debian point release).
"""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: wcd depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wcd"

SUITE = "bookworm"
# procps: /bin/kill, which wcd@.service's ExecReload= runs (the Debian package depends on it).
INCLUDE = ("systemd", "systemd-sysv", "python3", "procps")
ROOTFS_FORMAT = 1  # bump when the way the rootfs is built changes
SITE_FORMAT = 1
HOST_PACKAGES = {"systemd-nspawn": "systemd-container", "debootstrap": "debootstrap"}
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Unavailable(Exception):
    """This machine cannot run the system tests (the message says why): skip, don't fail."""


def say(msg: str) -> None:
    print(f"[system] {msg}", file=sys.stderr, flush=True)


# -- host tools ----------------------------------------------------------------------------------

def ensure_host_tools() -> None:
    if os.geteuid() != 0:
        raise Unavailable("needs root: systemd-nspawn boots a container")
    if platform.system() != "Linux":
        raise Unavailable("needs Linux")
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} (util-linux) is not installed")
    missing = sorted({pkg for tool, pkg in HOST_PACKAGES.items() if shutil.which(tool) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(HOST_PACKAGES)} are missing and there is no apt-get to install "
                          f"{' '.join(missing)}")
    say(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    for attempt in ([install], [["apt-get", "update", "-q"], install]):
        try:
            for cmd in attempt:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
                if res.returncode != 0:
                    break
        except subprocess.TimeoutExpired:
            res = None
        if all(shutil.which(tool) for tool in HOST_PACKAGES):
            return
    tail = (res.stdout + res.stderr)[-2000:] if res is not None else "timed out"
    raise Unavailable(f"{' '.join(missing)} missing and apt-get could not install them: {tail}")


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def _arch() -> str:
    """The Debian architecture (amd64, arm64) of this machine, which the container shares."""
    if shutil.which("dpkg"):
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


# -- the root filesystem -------------------------------------------------------------------------

def _mirror() -> str:
    """$WCD_DEBIAN_MIRROR, else the host's Debian mirror from its apt sources, else deb.debian.org."""
    if os.environ.get("WCD_DEBIAN_MIRROR"):
        return os.environ["WCD_DEBIAN_MIRROR"]
    texts = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if p.suffix in (".list", ".sources") and p.is_file():
            with contextlib.suppress(OSError):
                texts.append(p.read_text())
    for text in texts:
        for uri in re.findall(r"^\s*(?:deb\s+(?:\[[^]]*\]\s+)?|URIs:\s*)(\S+/debian)/?(?:\s|$)", text, re.M):
            if uri.startswith(("http://", "https://")):
                return uri
    return "http://deb.debian.org/debian"


def rootfs() -> Path:
    """A Debian root filesystem with systemd and python3: built once (~60-90 s), then cached."""
    arch = _arch()
    dest = CACHE / f"nspawn-rootfs-{_key(ROOTFS_FORMAT, SUITE, arch, INCLUDE)}"
    if dest.is_dir():
        return dest
    with _locked("nspawn-rootfs"):
        if dest.is_dir():
            return dest
        for stale in CACHE.glob(f".{dest.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = CACHE / f".{dest.name}.{os.getpid()}"
        mirror = _mirror()
        say(f"building the container's root filesystem ({SUITE}, {', '.join(INCLUDE)}) from {mirror} into {dest}; "
            "this takes a minute and is done once")
        log = CACHE / f"{dest.name}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            res = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}",
                                  f"--arch={arch}", SUITE, str(tmp), mirror],
                                 stdout=out, stderr=subprocess.STDOUT, timeout=900)
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"debootstrap failed (exit {res.returncode}); {log}:\n{log.read_text()[-3000:]}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (tmp / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        os.rename(tmp, dest)
        say(f"root filesystem built in {time.monotonic() - started:.0f} s")
        return dest


def container_python(root: Path) -> str:
    """The container's python3 version, 'X.Y', from the rootfs (its python3.X binary)."""
    versions = sorted(p.name[len("python"):] for p in (root / "usr/bin").glob("python3.*")
                      if re.fullmatch(r"python3\.\d+", p.name))
    if not versions:
        raise RuntimeError(f"{root} has no python3.X")
    return versions[-1]


def container_glibc(root: Path) -> tuple[int, int]:
    status = (root / "var/lib/dpkg/status").read_text()
    m = re.search(r"^Package: libc6\n(?:[^\n]+\n)*?Version: (\d+)\.(\d+)", status, re.M)
    if not m:
        raise RuntimeError(f"cannot find libc6's version in {root}/var/lib/dpkg/status")
    return int(m.group(1)), int(m.group(2))


# -- wcd's dependencies, for the container's python3 ---------------------------------------------

def site(root: Path) -> Path:
    """pyproject.toml's dependencies installed (`pip install --target`) for the container's python3.

    The wheels are fetched (and sdist-only ones such as sdnotify built) by a host python3 of the
    same X.Y, then installed from that local wheelhouse with pip's platform checks set to the
    container's (CPython X.Y, its glibc), so a host wheel the container cannot load is refused
    here instead of failing at import inside it.
    """
    pyver = container_python(root)
    glibc = container_glibc(root)
    machine = platform.machine()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    dest = CACHE / f"nspawn-site-{_key(SITE_FORMAT, pyver, glibc, machine, deps)}"
    if dest.is_dir():
        return dest
    python = _host_python(pyver)
    with _locked("nspawn-site"):
        if dest.is_dir():
            return dest
        for stale in CACHE.glob(f".{dest.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = CACHE / f".{dest.name}.{os.getpid()}"
        say(f"installing wcd's dependencies for the container's python {pyver} into {dest}")
        pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        nodot = pyver.replace(".", "")
        platforms = [f"manylinux_{glibc[0]}_{minor}_{machine}" for minor in range(17, glibc[1] + 1)]
        platforms += [f"manylinux2014_{machine}", f"linux_{machine}"]
        _run_host([*pip, "wheel", "-q", "-w", str(tmp / "wheels"), *deps], timeout=600)
        _run_host([*pip, "install", "-q", "--no-index", "--find-links", str(tmp / "wheels"), "--only-binary=:all:",
                   "--target", str(tmp / "site"), "--python-version", pyver, "--implementation", "cp",
                   "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none",
                   *(f"--platform={p}" for p in platforms), *deps], timeout=600)
        shutil.rmtree(tmp / "site" / "bin", ignore_errors=True)  # console scripts with host shebangs
        _readable(tmp / "site")
        os.rename(tmp / "site", dest)
        shutil.rmtree(tmp, ignore_errors=True)
        return dest


def _host_python(pyver: str) -> str:
    if "{}.{}".format(*sys.version_info[:2]) == pyver:
        return sys.executable
    for candidate in (f"/usr/bin/python{pyver}", shutil.which(f"python{pyver}")):
        if candidate and Path(candidate).exists() and subprocess.run(
                [candidate, "-m", "pip", "--version"], capture_output=True, timeout=60).returncode == 0:
            return candidate
    raise Unavailable(f"the container's python is {pyver}: building wcd's dependencies for it needs a host "
                      f"python{pyver} with pip (this is {sys.version.split()[0]})")


def _run_host(cmd: list[str], timeout: float) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        output = (res.stdout + res.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {res.returncode}):\n{output}")


def _readable(path: Path) -> None:
    """World-readable (the daemon runs as user wcd inside), whatever umask built it."""
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for f in filenames:
            p = os.path.join(dirpath, f)
            os.chmod(p, os.stat(p).st_mode & 0o777 | 0o444)


def stage(dest: Path, pyver: str) -> Path:
    """What the container gets of the working tree, at /opt/wcd: the wcd package (a copy, so that
    edits made meanwhile do not reach a running test), the units, and the test's own scripts."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "wcd", dest / "lib" / "wcd", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(REPO / "systemd", dest / "systemd")
    for script in ("checker.py", "setup-container.sh"):
        shutil.copy(HERE / script, dest / script)
    if "{}.{}".format(*sys.version_info[:2]) == pyver:  # same bytecode format: spare every start a compile
        compileall.compile_dir(dest / "lib", quiet=2)
    _readable(dest)
    return dest


# -- the container -------------------------------------------------------------------------------

class CommandFailed(AssertionError):
    pass


class Container:
    """A booted container. `run()` executes a shell command inside it as root."""

    def __init__(self, root: Path, binds: list[tuple[Path, str]], workdir: Path) -> None:
        self.root = root
        self.binds = binds
        self.name = f"wcd-test-{os.getpid()}"
        self.console = workdir / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader: int | None = None

    def boot(self, timeout: float = 60) -> None:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs -o mode=0755 tmpfs /run && exec "$@"', "sh",
               "systemd-nspawn", "--quiet", "--boot", f"--directory={self.root}", "--volatile=overlay",
               "--register=no", "--keep-unit", "--private-network", f"--machine={self.name}",
               "--console=read-only", *(f"--bind-ro={src}:{dst}" for src, dst in self.binds)]
        env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        with open(self.console, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.leader is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.console_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no systemd in the container after {timeout:g} s:\n{self.console_text()}")
            self.leader = _child_named(self.proc.pid, "systemd")
            time.sleep(0.05)
        # Right after exec, systemd has not yet bound its private bus socket: systemctl then fails
        # at once ("Failed to connect to bus"), or, before systemd has made /run/systemd/system,
        # answers "offline" (sd_booted() is false), so retry until it answers with a boot state.
        while True:
            res = self.run("systemctl is-system-running --wait", check=False,
                           timeout=max(5.0, deadline - time.monotonic()))
            state = res.stdout.strip()
            if state in ("running", "degraded", "maintenance", "stopping"):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the container's systemd did not finish booting ({state!r}, "
                                   f"{res.stderr.strip()!r}):\n{self.console_text()}")
            time.sleep(0.05)
        if state not in ("running", "degraded"):
            raise RuntimeError(f"the container's systemd did not finish booting ({state!r}):\n{self.console_text()}")
        if state == "degraded":  # not fatal (some unit of the minimal system failed); worth seeing
            say("container booted degraded: " + self.run("systemctl --failed --no-legend --plain",
                                                          check=False).stdout.strip())

    def run(self, command: str, *, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        assert self.leader is not None, "not booted"
        cmd = ["nsenter", "--target", str(self.leader), "--all", "--", "env", "-i", f"PATH={CONTAINER_PATH}",
               "LANG=C.UTF-8", "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0", "HOME=/root", "sh", "-c",
               f"umask 022\n{command}"]
        try:
            res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise CommandFailed(f"timed out after {timeout:g} s in the container: {command}\n"
                                f"stdout: {_text(e.stdout)}\nstderr: {_text(e.stderr)}") from None
        if check and res.returncode != 0:
            raise CommandFailed(f"exit {res.returncode} in the container: {command}\n"
                                f"stdout: {res.stdout[-3000:]}\nstderr: {res.stderr[-3000:]}")
        return res

    def out(self, command: str, **kw) -> str:
        return self.run(command, **kw).stdout.strip()

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        self.run(f'mkdir -p "$(dirname {path})" && cat >{path} && chmod {mode} {path}', input=text)

    def show(self, unit: str, prop: str) -> str:
        return self.out(f"systemctl show -p {prop} --value {unit}")

    def console_text(self) -> str:
        try:
            return self.console.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def diagnostics(self) -> str:
        """The container's journal and the wcd units' state, for a failure report."""
        if self.leader is None or self.proc is None or self.proc.poll() is not None:
            return f"(container not running)\nconsole:\n{self.console_text()}"
        parts = []
        for cmd in ("systemctl status --no-pager -l --lines=0 'wcd@*.socket' 'wcd@*.service'",
                    "journalctl -b --no-pager -o short-monotonic -n 400"):
            try:
                res = self.run(cmd, check=False, timeout=20)
                parts.append(f"$ {cmd}\n{res.stdout}{res.stderr}")
            except CommandFailed as e:
                parts.append(f"$ {cmd}\n{e}")
        return "\n".join(parts)

    def stop(self, timeout: float = 20) -> None:
        """Halt the container: SIGTERM to nspawn (a clean poweroff), SIGKILL if that hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            say(f"the container did not halt in {timeout:g} s: killing it")
        if self.leader is not None:  # the container's init: its death ends the whole pid namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.leader, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _child_named(pid: int, comm: str) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == comm:
                return int(child)
    return None


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return (data.decode(errors="replace") if isinstance(data, bytes) else data)[-3000:]
