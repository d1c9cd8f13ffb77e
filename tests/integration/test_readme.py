"""The README as a user copies it: every ```python block runs against a real daemon, and its
install and test lines name what really exists.

Each Python block runs in a fresh interpreter with WCD_SOCKET pointing at a daemon that serves a
small checkpoint under the README's model name. A block that imports an engine this environment
lacks (transformers, vllm) is skipped with that reason; `make test-engines` runs those engines.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_daemon import model_config
from wcd import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MODEL = "llama70b"  # the model name the README's examples use


def blocks(language: str) -> list[tuple[int, str]]:
    """(line number, text) of each fenced block in `language`."""
    found = []
    for m in re.finditer(rf"^```{language}\n(.*?)^```$", README, re.M | re.S):
        found.append((README.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


PYTHON = blocks("python")


@pytest.mark.slow
@pytest.mark.parametrize(("line", "code"), PYTHON, ids=[f"README.md:{n}" for n, _ in PYTHON])
def test_python_block_runs(make_daemon, tmp_path: Path, line: int, code: str) -> None:
    missing = [m for m in re.findall(r"^\s*(?:from|import) (\w+)", code, re.M) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (run by make test-engines)")
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    save_file({"embed.weight": torch.randn(64, 32), "lm_head.weight": torch.randn(32, 64)},
              str(ckpt / "model.safetensors"))
    d = make_daemon(model_config(ckpt, name=MODEL))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "WCD_SOCKET": str(d.socket)})
    assert out.returncode == 0, f"README.md:{line} fails:\n{out.stderr}"


def test_there_are_python_blocks() -> None:
    assert len(PYTHON) >= 2


def test_install_lines_name_the_distribution_not_pypis_wcd() -> None:
    shell = "\n".join(text for _, text in blocks("sh"))
    assert not re.search(r"pip install\s+['\"]?wcd(\[|['\"\s]|$)", README, re.M), "PyPI's wcd is another project"
    for line in re.findall(r"^\s*(?:python3? -m )?pip install .*$", shell, re.M):
        # From a checkout ('.', '.[extra]'), a built wheel, or plain dependencies: never by name.
        assert re.search(r"\s'?\.(\[\w+\])?'?(\s|$)|dist/|wcd_weight_cache-.*\.whl|torch|cuda-bindings", line), line
    assert f"`{DISTRIBUTION}`" in README


def test_two_commands_for_a_new_user_and_ci_runs_the_test_one() -> None:
    """One command sets up and runs the demo, one the tests; .ci/run calls the README's."""
    [(_, first)] = [b for b in blocks("sh") if "make demo" in b[1]]
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert "make test" in ci


@pytest.mark.slow
def test_the_wheel_install_line_matches_what_a_build_makes(tmp_path: Path) -> None:
    """The wheel the README installs is the one `pip wheel .` builds, and it carries wcd and its commands."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [wheel] = tmp_path.glob("*.whl")
    assert f"dist/{wheel.name}" in README  # name and version
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    assert (target / "wcd" / "__init__.py").exists() and (target / "bin" / "wcdctl").exists()
    [info] = target.glob("*.dist-info")
    assert f"Name: {DISTRIBUTION}\n" in (info / "METADATA").read_text()


def _log_pattern(fmt: str) -> re.Pattern[str]:
    """A %-format string as a regex matching what it prints (%s: anything, %d: digits, %.Nf: N decimals)."""
    parts = re.split(r"(%s|%d|%\.\df)", fmt)
    conv = {"%s": ".+?", "%d": r"\d+"}
    return re.compile("".join(conv.get(p) or (rf"\d+\.\d{{{p[2]}}}" if p.startswith("%.") else re.escape(p))
                              for p in parts) + "$")


def test_the_vllm_log_lines_are_what_the_loader_prints() -> None:
    """Each `wcd: attached ...` / `wcd: loaded weights ...` line the README shows matches the format
    the loader logs with (its %-format, with the optional parts as the code adds them)."""
    source = (ROOT / "wcd/integrations/vllm_loader.py").read_text()
    attached = re.search(r'log\.info\(("wcd: attached(?:[^"]*"\s*")*[^"]*")\s*,\s*lease\.entry', source)
    loaded = re.search(r'log\.info\(("wcd: loaded weights from %s in %\.3f s%s%s")', source)
    assert attached and loaded, "the loader's log calls moved: update this test"
    attached_fmt = "".join(re.findall(r'"([^"]*)"', attached.group(1)))
    shown = [line for line in README.splitlines() if line.startswith(("wcd: attached", "wcd: loaded weights"))]
    assert len(shown) == 3
    assert _log_pattern(attached_fmt).match(shown[0]), (attached_fmt, shown[0])
    # The two %s after the time: " (reasons)" and "; published processed weights as entry NAME".
    loaded_fmt = "wcd: loaded weights from %s in %.3f s (%s); published processed weights as entry %s"
    for line in shown[1:]:
        assert _log_pattern(loaded_fmt).match(line), line
    assert 'f"; published processed weights as entry {published}"' in source


def test_every_vllm_loader_option_is_documented() -> None:
    from wcd.integrations.vllm_shared import _OPTIONS

    documented = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    assert _OPTIONS <= documented, f"undocumented options: {sorted(_OPTIONS - documented)}"
