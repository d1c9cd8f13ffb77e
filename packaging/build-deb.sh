#!/usr/bin/env bash
# Build the Debian packages of wcd: dist/wcd_<version>_<arch>.deb and dist/wcd-cuda_<version>_<arch>.deb.
#
#   packaging/build-deb.sh [--no-lintian]
#
# For Debian 12 (bookworm), as root, or as a user once the build dependencies are installed:
# installs what is missing of them with apt-get, fetches the Python wheels pinned by hash in
# packaging/locks/ (pip, through the machine's pip configuration, so a mirror works too), builds
# with dpkg-buildpackage (debhelper; debian/ is packaging/debian/) in build/deb/, copies the .debs
# to dist/, and runs lintian, failing on any error. Idempotent: each run starts from a clean
# build tree; pip's cache makes a rebuild fetch nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PKG="$ROOT/packaging"
LINTIAN=1
for arg in "$@"; do
  case "$arg" in
    --no-lintian) LINTIAN=0 ;;
    -h|--help) sed -n '2,11s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "build-deb.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

# Debian's tools and its python3 only (not a pyenv or venv python that happens to come first).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
PY=/usr/bin/python3
say() { printf 'build-deb.sh: %s\n' "$*" >&2; }

# --- build dependencies (debian/control's Build-Depends, plus lintian) ---------------------------
# build-essential: dpkg-checkbuilddeps requires it implicitly on Debian.
BUILD_DEPS=(build-essential debhelper dh-python help2man python3 python3-pip dpkg-dev lintian)
missing=()
for p in "${BUILD_DEPS[@]}"; do
  dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    say "missing build dependencies: ${missing[*]} (run as root, or apt-get install them)"; exit 1
  fi
  say "installing ${missing[*]}"
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
fi

# --- versions ---------------------------------------------------------------------------------------
UPSTREAM=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$ROOT/pyproject.toml")
DEBVER=$(dpkg-parsechangelog -l "$PKG/debian/changelog" -S Version)
if [ "${DEBVER%-*}" != "$UPSTREAM" ]; then
  say "pyproject.toml says version $UPSTREAM but packaging/debian/changelog's latest entry is $DEBVER:"
  say "add an entry for $UPSTREAM-1 at the top of packaging/debian/changelog (by hand, or dch from devscripts)"
  exit 1
fi
ARCH=$(dpkg --print-architecture)

# --- source tree: what the package is built from, nothing else ------------------------------------
WORK="$ROOT/build/deb"
SRC="$WORK/wcd-$UPSTREAM"
rm -rf "$WORK"
mkdir -p "$SRC"
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
  -cf - pyproject.toml README.md wcd systemd packaging/grafana | tar -C "$SRC" -xf -
cp -a "$PKG/debian" "$SRC/debian"

# --- wheels, checked against the hashes in packaging/locks -----------------------------------------
"$PY" "$PKG/lock.py" --check
for lock in wcd wcd-cuda build; do
  mkdir -p "$SRC/debian/wheels/$lock"
  # `pip wheel`, not `pip download`: sdnotify has no wheel on PyPI, only an sdist, built here.
  # The hashes admit only the files lock.py chose (wheels; sdnotify's sdist).
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --require-hashes \
    -r "$PKG/locks/$lock.txt" -w "$SRC/debian/wheels/$lock" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
done

# --- build -------------------------------------------------------------------------------------------
say "building wcd $DEBVER for $ARCH"
start=$(date +%s)
(cd "$SRC" && dpkg-buildpackage -b -us -uc --jobs=auto) >"$WORK/build.log" 2>&1 \
  || { tail -n 40 "$WORK/build.log" >&2; say "dpkg-buildpackage failed; full log: $WORK/build.log"; exit 1; }
say "dpkg-buildpackage took $(( $(date +%s) - start )) s (log: build/deb/build.log)"

mkdir -p "$ROOT/dist"
rm -f "$ROOT"/dist/wcd_*.deb "$ROOT"/dist/wcd-cuda_*.deb
DEBS=("$ROOT/dist/wcd_${DEBVER}_${ARCH}.deb" "$ROOT/dist/wcd-cuda_${DEBVER}_${ARCH}.deb")
cp "$WORK/wcd_${DEBVER}_${ARCH}.deb" "$WORK/wcd-cuda_${DEBVER}_${ARCH}.deb" "$ROOT/dist/"

# --- lintian ---------------------------------------------------------------------------------------
if ((LINTIAN)); then
  # Errors fail the build; warnings are printed (packaging/README.md lists the known ones).
  lintian --fail-on error "${DEBS[@]}" >&2 || { say "lintian reported errors"; exit 1; }
fi
printf '%s\n' "${DEBS[@]}"
