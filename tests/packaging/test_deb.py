"""The Debian packages from packaging/build-deb.sh: control fields, contents, maintainer scripts,
lintian, and the installed layout actually running (unpacked with dpkg -x, and installed with
dpkg -i into a throwaway copy-on-write root).

Marked `package` (pytest -m package). Builds the packages unless dist/ holds a build newer than
every input (WCD_DEB_REBUILD=1 forces a build); skips without dpkg-deb.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pyproject.toml brings tomli there
    import tomli as tomllib  # type: ignore[no-redef]

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "packaging" / "build-deb.sh"
SYSTEM_PYTHON = "/usr/bin/python3"
# The dependencies the daemon needs (pyproject.toml), vendored as these top-level modules.
VENDORED = ["msgpack", "pydantic", "pydantic_core", "uvloop", "sdnotify", "safetensors", "prometheus_client", "tqdm"]


@dataclass(frozen=True)
class Debs:
    version: str
    arch: str
    wcd: Path
    cuda: Path


def run(*args: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    kw.setdefault("check", True)
    kw.setdefault("capture_output", True)
    return subprocess.run([str(a) for a in args], text=True, **kw)  # type: ignore[call-overload]


def inputs_mtime() -> float:
    """Newest modification time among the files the packages are built from."""
    paths = [ROOT / "pyproject.toml", ROOT / "README.md"]
    for d in ("wcd", "systemd", "packaging"):
        paths += [p for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return max(p.stat().st_mtime for p in paths)


@pytest.fixture(scope="module")
def debs() -> Debs:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not found: the Debian package is built and checked on Debian only")
    upstream = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    top = re.match(r"wcd \((\S+)\)", (ROOT / "packaging/debian/changelog").read_text())
    assert top, "packaging/debian/changelog does not start with a wcd entry"
    version = top.group(1)
    arch = run("dpkg", "--print-architecture").stdout.strip()
    assert version.rsplit("-", 1)[0] == upstream, "packaging/debian/changelog is behind pyproject.toml's version"
    found = Debs(version, arch, ROOT / f"dist/wcd_{version}_{arch}.deb", ROOT / f"dist/wcd-cuda_{version}_{arch}.deb")
    fresh = all(p.exists() and p.stat().st_mtime >= inputs_mtime() for p in (found.wcd, found.cuda))
    if not fresh or os.environ.get("WCD_DEB_REBUILD") == "1":
        if os.geteuid() != 0 and shutil.which("dh") is None:
            pytest.skip("debhelper is not installed and installing it needs root: run as root, or build "
                        "with packaging/build-deb.sh first")
        # lintian runs in its own test below.
        proc = run("bash", BUILD, "--no-lintian", check=False, timeout=900)
        assert proc.returncode == 0, f"packaging/build-deb.sh failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    assert found.wcd.exists() and found.cuda.exists()
    return found


def field(deb: Path, name: str) -> str:
    return run("dpkg-deb", "-f", deb, name).stdout.strip()


def relations(value: str) -> list[str]:
    return [r.strip() for r in value.split(",") if r.strip()]


def contents(deb: Path) -> dict[str, str]:
    """path (without the leading ./) -> `dpkg-deb -c` mode string."""
    out: dict[str, str] = {}
    for line in run("dpkg-deb", "-c", deb).stdout.splitlines():
        cols = line.split(None, 5)
        path = cols[5].split(" -> ")[0].removeprefix("./").rstrip("/")
        if path:
            out[path] = cols[0]
    return out


def member(deb: Path, path: str) -> bytes:
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        f = t.extractfile("./" + path)
        assert f is not None, path
        return f.read()


# --- control fields -----------------------------------------------------------------------------


def test_control_fields(debs: Debs) -> None:
    assert field(debs.wcd, "Package") == "wcd"
    assert field(debs.wcd, "Version") == debs.version
    assert field(debs.wcd, "Architecture") == debs.arch
    depends = relations(field(debs.wcd, "Depends"))
    # /bin/kill in ExecReload=; systemd-sysusers in postinst; the exact python3 of the vendored
    # cpython-3XY extension modules (Debian 12: 3.11).
    assert "procps" in depends
    assert any(r.startswith("python3 (>= 3.11") for r in depends), depends
    assert "python3 (<< 3.12)" in depends, depends
    assert any("systemd" in r.split("|")[0] and "sysusers" in r for r in depends), depends
    # Vendored, so no python3-* packages; never torch, nothing CUDA.
    everything = " ".join(field(debs.wcd, f) for f in ("Depends", "Pre-Depends", "Recommends", "Suggests"))
    assert not re.search(r"\bpython3-", everything), everything
    assert "torch" not in everything and "nvidia" not in everything and "cuda" not in field(debs.wcd, "Depends")
    assert relations(field(debs.wcd, "Recommends")) == ["wcd-cuda"]

    assert field(debs.cuda, "Package") == "wcd-cuda"
    cuda_depends = relations(field(debs.cuda, "Depends"))
    assert f"wcd (= {debs.version})" in cuda_depends, cuda_depends
    assert "torch" not in field(debs.cuda, "Depends")


def test_conffiles(debs: Debs) -> None:
    info = run("dpkg-deb", "-I", debs.wcd).stdout
    assert "conffiles" in info
    assert run("dpkg-deb", "-I", debs.wcd, "conffiles").stdout.split() == ["/etc/wcd/example.toml"]


# --- contents -----------------------------------------------------------------------------------


def test_contents(debs: Debs) -> None:
    files = contents(debs.wcd)
    for path in ("usr/bin/wcd", "usr/bin/wcdctl"):
        assert files.get(path, "").startswith("-rwxr-xr-x"), (path, files.get(path))
    for path in ("usr/lib/systemd/system/wcd@.service", "usr/lib/systemd/system/wcd@.socket",
                 "usr/lib/sysusers.d/wcd.conf", "usr/lib/tmpfiles.d/wcd.conf", "etc/wcd/example.toml",
                 "usr/lib/wcd/wcd/__init__.py", "usr/lib/wcd/wcd/cli/wcdctl.py",
                 "usr/share/man/man1/wcd.1.gz", "usr/share/man/man1/wcdctl.1.gz",
                 "usr/share/doc/wcd/copyright", "usr/share/doc/wcd/README.Debian", "usr/share/wcd/grafana/wcd.json"):
        assert files.get(path, "").startswith("-rw-r--r--"), (path, files.get(path))
    top = {p.split("/")[3] for p in files if p.startswith("usr/lib/wcd/") and p.count("/") >= 3}
    for module in VENDORED:
        assert module in top, f"{module} is not vendored in /usr/lib/wcd"
    assert not [m for m in top if m.lower().startswith(("torch", "nvidia", "cuda"))], sorted(top)
    assert not [p for p in files if "__pycache__" in p or p.endswith(".pyc")], "bytecode is made by py3compile"

    cuda = contents(debs.cuda)
    assert any(re.fullmatch(r"usr/lib/wcd/cuda/bindings/driver\.cpython-\d+-.*\.so", p) for p in cuda)
    assert not [p for p in cuda if "torch" in p]
    # The two packages share only directories.
    shared = {p for p in set(files) & set(cuda) if not files[p].startswith("d")}
    assert not shared, sorted(shared)


def test_units_and_snippets_are_the_repositorys(debs: Debs) -> None:
    for shipped, source in (("usr/lib/systemd/system/wcd@.service", "wcd@.service"),
                            ("usr/lib/systemd/system/wcd@.socket", "wcd@.socket"),
                            ("usr/lib/sysusers.d/wcd.conf", "wcd.sysusers"),
                            ("usr/lib/tmpfiles.d/wcd.conf", "wcd.tmpfiles"),
                            ("etc/wcd/example.toml", "example.toml")):
        assert member(debs.wcd, shipped) == (ROOT / "systemd" / source).read_bytes(), shipped
    assert member(debs.wcd, "usr/share/wcd/grafana/wcd.json") == (ROOT / "packaging/grafana/wcd.json").read_bytes()
    service = member(debs.wcd, "usr/lib/systemd/system/wcd@.service").decode()
    exec_start = re.search(r"^ExecStart=(\S+)", service, re.M)
    assert exec_start and exec_start.group(1) == "/usr/bin/wcd"
    assert "usr/bin/wcd" in contents(debs.wcd)


def test_maintainer_scripts(debs: Debs, tmp_path: Path) -> None:
    run("dpkg-deb", "-e", debs.wcd, tmp_path / "control")
    scripts = {name: (tmp_path / "control" / name).read_text() for name in ("postinst", "prerm", "postrm")}
    for name, text in scripts.items():
        run("sh", "-n", tmp_path / "control" / name)  # syntax
        # Template units: nothing is ever enabled or started by the package.
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"deb-systemd-helper\s+(enable|unmask)|systemctl\s+(enable|start|restart)\b"
                             r"|deb-systemd-invoke\s+(start|restart)\b", code), name
    postinst = scripts["postinst"]
    sysusers = postinst.find("systemd-sysusers")
    tmpfiles = postinst.find("systemd-tmpfiles")
    assert 0 <= sysusers < tmpfiles, "the wcd group must exist before /run/wcd is made root:wcd"
    assert re.search(r"systemd-sysusers\b.*\bwcd\.conf", postinst)
    assert re.search(r"systemd-tmpfiles\b.*--create\b.*\bwcd\.conf", postinst)
    assert "py3compile -p wcd" in postinst
    assert re.search(r"deb-systemd-invoke try-restart 'wcd@\*\.service'", postinst)  # only on upgrade
    assert re.search(r"deb-systemd-invoke stop 'wcd@\*\.socket' 'wcd@\*\.service'", scripts["prerm"])


# --- lintian ------------------------------------------------------------------------------------


def test_lintian_reports_no_errors(debs: Debs) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("lintian is not installed (packaging/build-deb.sh installs it)")
    proc = run("lintian", "--fail-on", "none", debs.wcd, debs.cuda)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("E:")]
    assert not errors, "\n".join(errors)


# --- the installed layout, running --------------------------------------------------------------


def tiny_checkpoint(path: Path) -> None:
    """A valid two-tensor safetensors file, written without torch."""
    header = {"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
              "b": {"dtype": "U8", "shape": [300], "data_offsets": [64, 364]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(range(256)) * 2)


@pytest.fixture
def unpacked(debs: Debs, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    run("dpkg-deb", "-x", debs.wcd, root)
    return root


def test_unpacked_layout_runs_without_torch(unpacked: Path, tmp_path: Path) -> None:
    """`dpkg -x`: the launchers find /usr/lib/wcd next to them; the daemon serves a checkpoint
    with Debian's python3 and the vendored modules only, and never imports torch."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"{SYSTEM_PYTHON} not found")
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    wcd, wcdctl = unpacked / "usr/bin/wcd", unpacked / "usr/bin/wcdctl"
    assert "serve" in run(wcd, "--help", env=env).stdout
    assert "status" in run(wcdctl, "--help", env=env).stdout

    tiny_checkpoint(tmp_path / "tiny.safetensors")
    sock = tmp_path / "wcd.sock"
    (tmp_path / "wcd.toml").write_text(
        f'[daemon]\nsocket = "{sock}"\nbudget = {{ cpu = "64MiB" }}\n\n'
        f'[[models]]\nname = "tiny"\npath = "{tmp_path / "tiny.safetensors"}"\ndevice = "cpu"\n')
    # The launcher's own interpreter flags, and -X importtime, which lists every module the daemon
    # imports, on stderr.
    flags = wcd.read_text().splitlines()[0].split()[1:]
    assert "-SsP" in flags  # no site: nothing of the system's dist-packages runs or is found
    with open(tmp_path / "daemon.log", "wb") as log:  # the child keeps its own copy of the fd
        daemon = subprocess.Popen([SYSTEM_PYTHON, *flags, "-X", "importtime", str(wcd), "serve", "--config",
                                   str(tmp_path / "wcd.toml")], env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(sock))
                    break
                except OSError:
                    pass
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "daemon did not listen within 30 s"
            time.sleep(0.05)
        ctl = [str(wcdctl), "--socket", str(sock)]
        while [e["state"] for e in json.loads(run(*ctl, "--json", "list", env=env).stdout)["entries"]] != ["ready"]:
            assert time.monotonic() < deadline, "tiny checkpoint not ready within 30 s"
            time.sleep(0.05)
        run(*ctl, "verify", "tiny", env=env)
        assert "wcd" in run(*ctl, "metrics", env=env).stdout
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    log = (tmp_path / "daemon.log").read_text()
    imported = {m.group(1).strip().split(".")[0] for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", log, re.M)}
    assert "uvloop" in imported and "pydantic" in imported and "msgpack" in imported
    assert "torch" not in imported, "the daemon imported torch"
    for module in ("wcd", "uvloop", "pydantic", "msgpack"):
        origin = run(SYSTEM_PYTHON, *flags, "-c", f"import sys; sys.path.insert(0, {str(unpacked / 'usr/lib/wcd')!r}); "
                     f"import {module}; print({module}.__file__)", env=env).stdout.strip()
        assert origin.startswith(str(unpacked / "usr/lib/wcd")), (module, origin)


CHROOT_SCRIPT = r"""
set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive
cd /
dpkg -i /tmp/debs/wcd_*.deb /tmp/debs/wcd-cuda_*.deb >/tmp/debs/dpkg.log 2>&1 || { cat /tmp/debs/dpkg.log; exit 1; }
dpkg-query -W -f='${Status}\n' wcd wcd-cuda
wcd --help >/dev/null
wcdctl --help >/dev/null
echo "command: $(command -v wcd) $(command -v wcdctl)"
echo "user: $(getent passwd wcd | cut -d: -f1,6,7)"
echo "group: $(getent group wcd | cut -d: -f1)"
echo "run: $(stat -c '%U:%G %a' /run/wcd)"
echo "conffiles: $(dpkg-query -W -f='${Conffiles}' wcd | awk 'NF {print $1}')"
echo "pyc: $(ls /usr/lib/wcd/wcd/__pycache__/__init__.cpython-*.pyc /usr/lib/wcd/cuda/bindings/__pycache__/__init__.cpython-*.pyc | wc -l)"
echo "enabled: $(find /etc/systemd/system -name 'wcd@*' | wc -l)"
python3 -SsP -c 'import sys; sys.path.insert(0, "/usr/lib/wcd"); import cuda.bindings.driver, wcd.arenas.cuda; print("cuda: ok")'
dpkg --purge wcd-cuda wcd >/tmp/debs/purge.log 2>&1 || { cat /tmp/debs/purge.log; exit 1; }
echo "purged: $(ls -A /usr/lib/wcd /etc/wcd /usr/bin/wcd /usr/bin/wcdctl 2>/dev/null | wc -l)"
"""  # noqa: E501 (shell, as run in the chroot)

CHROOT_EXPECTED = """install ok installed
install ok installed
command: /usr/bin/wcd /usr/bin/wcdctl
user: wcd:/:/usr/sbin/nologin
group: wcd
run: root:wcd 750
conffiles: /etc/wcd/example.toml
pyc: 2
enabled: 0
cuda: ok
purged: 0
"""


@pytest.fixture
def throwaway_root(tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    """A copy-on-write view of this machine's / (overlayfs in a private mount namespace): dpkg -i
    and the maintainer scripts run chrooted in it and change nothing outside tmp_path."""
    if os.geteuid() != 0:
        pytest.skip("installing with dpkg -i into a throwaway root needs root")
    for tool in ("unshare", "chroot", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found")
    layers = tmp_path / "overlay"
    for d in ("upper", "work", "merged"):
        (layers / d).mkdir(parents=True)
    (layers / "upper/tmp/debs").mkdir(parents=True)
    merged = layers / "merged"
    # /dev and /proc from the host, a fresh /run (so the scripts see no running systemd) and /tmp.
    setup = (f"mount -t overlay overlay -o lowerdir=/,upperdir={layers / 'upper'},workdir={layers / 'work'} {merged}"
             f" && mount --rbind /dev {merged}/dev && mount -t proc proc {merged}/proc"
             f" && mount -t tmpfs tmpfs {merged}/run && mount -t sysfs sysfs {merged}/sys")
    probe = run("unshare", "--mount", "--propagation", "private", "sh", "-c", f"{setup} && echo ok", check=False)
    if probe.returncode != 0 or probe.stdout.strip() != "ok":
        pytest.skip(f"cannot mount an overlay of / here: {probe.stderr.strip()[-300:]}")
    chroot = f'{setup} && exec chroot {merged} sh -c "$0"'
    yield ["unshare", "--mount", "--propagation", "private", "sh", "-c", chroot], layers / "upper/tmp/debs"


def test_dpkg_install_into_throwaway_root(debs: Debs, throwaway_root: tuple[list[str], Path]) -> None:
    """dpkg -i both packages: postinst makes the wcd user and group and /run/wcd (root:wcd 0750),
    byte-compiles /usr/lib/wcd, enables and starts nothing; wcd and wcdctl run from PATH; purge
    removes everything again."""
    command, debs_dir = throwaway_root
    shutil.copy(debs.wcd, debs_dir)
    shutil.copy(debs.cuda, debs_dir)
    proc = run(*command, CHROOT_SCRIPT, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == CHROOT_EXPECTED, proc.stdout + proc.stderr
